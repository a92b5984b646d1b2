"""The model mechanisms of the imported families, each against a reference computed here
(transformers' parity is tests/test_families_hf.py):

F3  the sliding-window mask is exactly {(i, j): 0 <= i - j < W} (transformers' and llama.cpp's rule),
    for every backend's mask form, packed with documents, and in the KV cache;
F5  soft-capping: attention scores c tanh(s / c) after scaling and before the mask; the fused loss
    with a final soft-cap equals plain cross-entropy on capped logits, gradients included;
    every backend computes a mechanism or refuses it (sdpa cannot soft-cap);
    the fused decode step equals the full forward for every mechanism (sandwich / post norms,
    (1 + w) norms, projection QK-norm, GeGLU, scales, soft-caps, sliding layers with their own
    RoPE base, NoPE layers), with left padding and with per-row slots;
    the defaults are today's model: the same parameters, draws and numbers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmforge.config import ModelConfig
from lmforge.errors import ConfigError
from lmforge.generate import left_pad
from lmforge.model import Transformer
from lmforge.model.attention import additive_document_mask, cache_mask, document_mask, prepare_mask, \
    resolve_backend, window_mask
from lmforge.model.loss import cross_entropy_sum, linear_cross_entropy_sum

VOCAB = 160

GEMMA3 = dict(dim=64, n_layers=7, n_heads=2, n_kv_heads=1, head_dim=48, norm_offset=1.0, norm_placement="sandwich",
              qk_norm=True, qk_norm_scope="head", mlp_activation="gelu_tanh", embed_scale=8.0, attn_scale=40 ** -0.5,
              layer_types=["sliding"] * 5 + ["full"] + ["sliding"], sliding_window=6, rope_theta=1e6,
              rope_theta_sliding=1e4, tie_embeddings=True, ffn_dim=96)
GEMMA2 = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=24, norm_offset=1.0, norm_placement="sandwich",
              qk_norm=False, mlp_activation="gelu_tanh", embed_scale=8.0, attn_scale=20 ** -0.5, attn_softcap=2.0,
              final_softcap=3.0, layer_types=["sliding", "full"] * 2, sliding_window=5, tie_embeddings=True, ffn_dim=96)
OLMO2 = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=4, norm_placement="post", qk_norm=True,
             qk_norm_scope="projection", ffn_dim=96)
NOPE = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, qk_norm=False, nope_layers=[1, 3],
            layer_types=["full", "sliding", "full", "sliding"], sliding_window=4)
#: Granite's four scalars (a logit scale below 1: the logits grow, so a missed division shows)
SCALARS = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, qk_norm=False, embed_scale=6.0, attn_scale=0.1,
               residual_scale=0.22, logit_scale=0.5)
MECHANISMS = {"gemma3": GEMMA3, "gemma2": GEMMA2, "olmo2": OLMO2, "nope": NOPE, "scalars": SCALARS}


def build(fields: dict, seed: int = 0, max_seq_len: int = 64) -> Transformer:
    m = Transformer(ModelConfig(vocab_size=VOCAB, max_seq_len=max_seq_len, **fields))
    m.reset_parameters(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # every norm weight random: zeros (Gemma's init) hide offset and placement bugs
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m.eval()


# -- F3: the window ------------------------------------------------------------------------------
@pytest.mark.parametrize("W", [1, 4, 6])
@pytest.mark.parametrize("extra", [-1, 0, 2])
def test_window_mask_is_exactly_the_band(W, extra):
    T = max(1, W + extra) if extra != 2 else 3 * W
    got = window_mask(T, T, 0, W, "cpu")
    want = torch.tensor([[0 <= i - j < W for j in range(T)] for i in range(T)])
    assert torch.equal(got, want)
    docs = torch.zeros(1, T, dtype=torch.long)
    assert torch.equal(document_mask(docs, W)[0, 0], want)
    add = additive_document_mask(docs, torch.float32, W)[0, 0]
    assert torch.equal(add == 0, want) and bool((add[~want] == float("-inf")).all())
    # in the cache: queries at slots 5.. over S keys, the same rule by slot distance
    S = T + 5
    cm = cache_mask(T, 5, None, S, "cpu", W)[0, 0]
    assert torch.equal(cm, torch.tensor([[0 <= i + 5 - j < W for j in range(S)] for i in range(T)]))


def test_window_and_documents_combine():
    docs = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])
    W = 3
    got = document_mask(docs, W)[0, 0]
    want = torch.tensor([[docs[0, i] == docs[0, j] and 0 <= i - j < W for j in range(12)] for i in range(12)])
    assert torch.equal(got, want)
    m = prepare_mask("sdpa", 12, "cpu", torch.float32, docs, window=W)
    assert torch.equal(m.attn_mask[0, 0] == 0, want)


def test_a_window_that_never_slides_is_full_attention():
    assert prepare_mask("sdpa", 6, "cpu", torch.float32, None, window=6).is_causal
    assert not prepare_mask("sdpa", 7, "cpu", torch.float32, None, window=6).is_causal


@torch.no_grad()
def test_sliding_layers_see_only_their_window():
    """Changing a token more than W - 1 positions back changes nothing in a model of sliding layers
    only; one position closer, it does."""
    m = build(dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, qk_norm=False, layer_types=["sliding"] * 2,
                   sliding_window=3))
    x = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    base = m(x)[0, -1]
    far, near = x.clone(), x.clone()
    far[0, 12 - 1 - 2 * 2 - 1] = (far[0, 6] + 1) % VOCAB  # 2 layers of W = 3 reach 4 positions back
    near[0, 12 - 1 - 2 * 2] = (near[0, 7] + 1) % VOCAB
    assert torch.equal(m(far)[0, -1], base)
    assert not torch.allclose(m(near)[0, -1], base)


@pytest.mark.parametrize("family", list(MECHANISMS))
@torch.no_grad()
def test_packed_documents_equal_each_alone(family):
    m = build(MECHANISMS[family], seed=3)
    g = torch.Generator().manual_seed(5)
    a, b = torch.randint(0, VOCAB, (1, 15), generator=g), torch.randint(0, VOCAB, (1, 9), generator=g)
    tokens = torch.cat([a, b], 1)
    docs = torch.tensor([[0] * 15 + [1] * 9])
    positions = torch.cat([torch.arange(15), torch.arange(9)])[None]
    packed = m(tokens, positions, docs)
    torch.testing.assert_close(packed[:, :15], m(a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 15:], m(b), rtol=1e-5, atol=1e-5)


# -- F5: soft-caps ---------------------------------------------------------------------------------
def test_attention_softcap_is_applied_after_scaling_before_the_mask():
    from lmforge.model.attention import AttentionMask, eager_attend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) * 3 for _ in range(3))
    scale, cap = 0.3, 1.5
    s = (q @ k.mT) * scale
    s = cap * torch.tanh(s / cap)
    s = s.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    want = s.softmax(-1) @ v
    got = eager_attend(q, k, v, AttentionMask(is_causal=True), scale, cap)
    torch.testing.assert_close(got, want)
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    from lmforge.model.attention import flex_attend

    mask = prepare_mask("flex", 5, "cpu", torch.float32)
    assert flex is not None
    torch.testing.assert_close(flex_attend(q, k, v, mask, scale, cap), want, rtol=1e-5, atol=1e-5)


def test_sdpa_refuses_a_softcap_and_auto_picks_one_that_computes_it():
    assert resolve_backend("auto", "cpu", softcap=50.0) == "eager"
    assert resolve_backend("auto", "cpu") == "sdpa"
    with pytest.raises(ConfigError, match="attn_softcap"):
        resolve_backend("sdpa", "cpu", softcap=50.0)
    m = build(GEMMA2)
    assert m.layers[0].attention.backend == "eager"
    with pytest.raises(ConfigError, match="soft-cap"):
        m.set_attention("sdpa")


@pytest.mark.parametrize("chunk", [3, 1024])
def test_fused_loss_with_final_softcap_equals_cross_entropy_of_capped_logits(chunk):
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(2, 7, 16, generator=g) * 0.5).requires_grad_()
    w = torch.randn(VOCAB, 16, generator=g).requires_grad_()
    targets = torch.randint(0, VOCAB, (2, 7), generator=g)
    mask = torch.rand(2, 7, generator=g) > 0.3
    cap = 3.0
    got = linear_cross_entropy_sum(h, w, targets, mask, chunk_rows=chunk, softcap=cap)
    gh, gw = torch.autograd.grad(got, (h, w))
    logits = cap * torch.tanh((h @ w.T) / cap)
    assert float(logits.detach().abs().max()) < cap  # capped, and in tanh's curved part
    want = cross_entropy_sum(logits, targets, mask)
    wh, ww = torch.autograd.grad(want, (h, w))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gh, wh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, ww, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_residual_and_logit_scales_act_where_granite_puts_them():
    """residual_scale multiplies each sublayer's output before the residual add; logit_scale divides
    the logits, in the loss too: the model equals one computed by hand from its own modules."""
    m = build(SCALARS, seed=2)
    x = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    h = m.tok_embeddings(x) * 6.0
    for block in m.layers:  # each block's modules, the residual scale written out
        rope = tuple(t[torch.arange(11)][None, None] for t in (m.rope_cos, m.rope_sin))
        mask = prepare_mask(block.attention.backend, 11, "cpu", torch.float32)
        h = h + 0.22 * block.attention(block.attention_norm(h), rope, mask)
        h = h + 0.22 * block.feed_forward(block.ffn_norm(h))
    want = (m.norm(h) @ m.output.weight[:VOCAB].T) / 0.5
    torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)
    targets = torch.roll(x, -1, 1)
    torch.testing.assert_close(m(x, targets=targets), F.cross_entropy(want.reshape(-1, VOCAB), targets.reshape(-1),
                                                                       reduction="sum"), rtol=1e-5, atol=1e-4)


@torch.no_grad()
def test_model_loss_and_logits_carry_the_final_softcap():
    m = build(GEMMA2, seed=2)
    x = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    logits = m(x)
    assert float(logits.abs().max()) < 3.0
    targets = torch.roll(x, -1, 1)
    torch.testing.assert_close(m(x, targets=targets), F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1),
                                                                       reduction="sum"), rtol=1e-5, atol=1e-4)


# -- the fused decode step, every mechanism ---------------------------------------------------------
@pytest.mark.parametrize("family", list(MECHANISMS))
@torch.inference_mode()
def test_decode_step_equals_full_forward(family):
    m = build(MECHANISMS[family], seed=4)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 3, 13)]
    steps = 10  # past every window
    tokens, positions, key_mask = left_pad(seqs, 0, steps)
    cache = m.new_cache(len(seqs), tokens.shape[1] + steps, key_mask)
    logits = m(tokens, positions, cache=cache)[:, -1]
    for i, s in enumerate(seqs):
        torch.testing.assert_close(logits[i], m(torch.tensor([s]))[0, -1], rtol=1e-5, atol=1e-5)
    pos = positions[:, -1] + 1
    for _ in range(steps):
        nxt = logits.argmax(-1)
        for i, s in enumerate(seqs):
            s.append(int(nxt[i]))
        logits = m.decode_step(nxt, pos, cache)
        pos = pos + 1
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], m(torch.tensor([s]))[0, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
@torch.inference_mode()
def test_decode_step_with_per_row_slots_equals_full_forward(family):
    m = build(MECHANISMS[family], seed=6)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 1, 12)]
    cache = m.new_cache(3, 64)
    logits = torch.stack([m(torch.tensor([s]), cache=cache.rows(i, i + 1))[0, -1] for i, s in enumerate(seqs)])
    for _ in range(8):
        nxt = logits.argmax(-1)
        slots = torch.tensor([len(s) for s in seqs])
        for i, s in enumerate(seqs):
            s.append(int(nxt[i]))
        logits = m.decode_step(nxt, slots, cache, slots=slots)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], m(torch.tensor([s]))[0, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gemma3", "olmo2"])
def test_bf16_autocast_forward_stays_near_fp32(family):
    m = build(MECHANISMS[family], seed=1)
    x = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = m(x).float()
    assert float((low - ref).abs().max()) < 0.1 * float(ref.abs().max()) + 0.1


def test_gemma_norms_start_at_a_gain_of_one():
    m = Transformer(ModelConfig(vocab_size=VOCAB, **GEMMA3))
    for name, p in m.named_parameters():
        if name.endswith("norm.weight"):
            assert bool((p == 0).all()), name
    x = torch.randn(3, 64)
    torch.testing.assert_close(m.norm(x), F.rms_norm(x, (64,), eps=m.config.norm_eps))


def test_layer_types_must_match_the_layers():
    from lmforge.config import Config, validate

    cfg = Config()
    cfg.model.layer_types = ["sliding", "full"]
    with pytest.raises(ConfigError, match="layer_types"):
        validate(cfg)
    cfg.model.layer_types = ["sliding"] * cfg.model.n_layers
    with pytest.raises(ConfigError, match="sliding_window"):
        validate(cfg)
    cfg.model.sliding_window = 8
    validate(cfg)
