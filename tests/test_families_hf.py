"""Gemma 3 (text), Gemma 2, OLMo 2, Mistral with a window that slides, SmolLM3 (NoPE layers),
Granite (embedding, attention, residual and logit scalars) and Phi-3 (fused qkv_proj and
gate_up_proj; with and without a window), through `lmforge
import-hf` and `lmforge export`, against `transformers` itself (eager attention, fp32, CPU).

The tiny models of `hf_families` (every norm weight random; Gemma 3: 7 layers, 5 sliding : 1
full, window W = 6, head_dim 48 != 64 / 2, query_pre_attn_scalar 40 != head_dim, RoPE bases 1e6 /
1e4; Gemma 2: soft-caps 2 and 3, alternating layers) are imported and compared:

- F1 logits equal transformers' within 1e-5 at T = 3W + 5 (the window slides), batch 2, for
  each lmforge attention backend ("sdpa", "eager", and "flex" forward-only on CPU); Gemma 2
  with "sdpa" (no soft-cap) is refused;
- F2 two documents packed in one row (positions restarting, `document_ids`) equal each
  document alone through transformers, one of them longer than W;
- F4 greedy decoding through the KV cache and the fused decode step equals transformers'
  `generate(do_sample=False)` for 2W + 8 new tokens (the window slides during decode);
- F6 import -> export -> the exported tensors are bit-identical to transformers' originals,
  config.json carries the family's keys, `AutoModelForCausalLM` loads it as the family with
  equal logits, and its re-import is the same lmforge model.

Refusals (Gemma 3's image-text model, RoPE scaling on Gemma, ...) name the field.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_families import build_folder  # noqa: E402

from lmforge.config import ModelConfig  # noqa: E402
from lmforge.errors import ConfigError  # noqa: E402
from lmforge.export import ExportError, export_hf, hf_config, import_hf, map_name  # noqa: E402
from lmforge.export.families import FAMILIES as RECORDS  # noqa: E402
from lmforge.fileio import load_safetensors  # noqa: E402
from lmforge.model import load_model  # noqa: E402

FAMILIES = ["gemma3", "gemma2", "olmo2", "mistral_sliding", "smollm3", "granite", "phi3", "phi3_sliding"]
#: hf_families' family -> (model_type, architecture)
NAMES = {"gemma3": ("gemma3_text", "Gemma3ForCausalLM"), "gemma2": ("gemma2", "Gemma2ForCausalLM"),
         "olmo2": ("olmo2", "Olmo2ForCausalLM"), "mistral_sliding": ("mistral", "MistralForCausalLM"),
         "smollm3": ("smollm3", "SmolLM3ForCausalLM"), "granite": ("granite", "GraniteForCausalLM"),
         "phi3": ("phi3", "Phi3ForCausalLM"), "phi3_sliding": ("phi3", "Phi3ForCausalLM")}
W = 6  # hf_families' sliding window (OLMo 2 has none: its T is the others')
T1 = 3 * W + 5
def hf_logits(model, tokens: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.inference_mode():
        return model(tokens, **kwargs).logits


def edited(src: Path, dst: Path, **changes) -> Path:
    """A copy of `src` with config.json keys changed (None: removed)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module", params=FAMILIES)
def imported(request, tmp_path_factory):
    """(family, HF model (eager), HF tokenizer, HF folder, lmforge checkpoint, import log lines)."""
    family = request.param
    tmp = tmp_path_factory.mktemp(family)
    model, fast = build_folder(family, tmp / "hf")
    lines: list[str] = []
    import_hf(tmp / "hf", tmp / "ckpt", log=lines.append)
    return family, model, fast, tmp / "hf", tmp / "ckpt", lines


def random_tokens(n_vocab: int, B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, n_vocab, (B, T), generator=torch.Generator().manual_seed(seed))


# -- the config: each mechanism mapped ------------------------------------------------------------
def test_config_maps_every_mechanism(imported):
    family, hf, _, _, ckpt, lines = imported
    m = load_model(ckpt)[0].config
    c = hf.config
    kinds = {"full_attention": "full", "sliding_attention": "sliding"}
    hf_types = [kinds[t] for t in getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers]
    if family in ("mistral_sliding", "phi3_sliding"):  # transformers' Mistral and Phi-3: the window in every layer
        hf_types = ["sliding"] * c.num_hidden_layers
    assert (m.layer_types or ["full"] * m.n_layers) == hf_types
    assert m.resolved_head_dim() == getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)
    if family in ("gemma3", "gemma2"):
        assert (m.norm_offset, m.norm_placement, m.mlp_activation) == (1.0, "sandwich", "gelu_tanh")
        assert m.embed_scale == 64 ** 0.5 and m.attn_scale == 40 ** -0.5 and m.head_dim == 48
        assert m.sliding_window == W and m.tie_embeddings
    if family == "gemma3":
        assert hf_types == ["sliding"] * 5 + ["full", "sliding"]
        assert (m.rope_theta, m.rope_theta_sliding) == (1e6, 1e4)
        assert m.qk_norm and m.qk_norm_scope == "head" and (m.attn_softcap, m.final_softcap) == (0.0, 0.0)
    if family == "gemma2":
        assert hf_types == ["sliding", "full"] * 2 and not m.qk_norm
        assert (m.attn_softcap, m.final_softcap) == (2.0, 3.0)
    if family == "olmo2":
        assert m.norm_placement == "post" and m.qk_norm and m.qk_norm_scope == "projection" and not m.layer_types
    if family == "mistral_sliding":
        assert m.sliding_window == W and any("every layer attends to its last 6 keys" in x for x in lines)
    if family == "granite":  # the four scalars, each its own mechanism
        assert (m.embed_scale, m.attn_scale, m.residual_scale, m.logit_scale) == (6.0, 0.1, 0.22, 0.5)
    if family.startswith("phi3"):  # Llama's computation, exported back as Phi-3 by the family imported
        assert m.family == "phi3" and m.n_kv_heads < m.n_heads and not m.qkv_bias
    if family == "smollm3":  # transformers' no_rope_layers [1, 1, 1, 0]: the last layer skips RoPE
        assert c.no_rope_layers == [1, 1, 1, 0] and m.nope_layers == [3] and not m.layer_types


# -- F1: logits ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["sdpa", "eager", "flex"])
def test_f1_logits_equal_transformers_eager(imported, backend):
    """T = 3W + 5, batch 2: every position of every layer kind, the window sliding."""
    family, hf, fast, _, ckpt, _ = imported
    ours = load_model(ckpt)[0]
    if backend == "sdpa" and ours.config.attn_softcap:  # Gemma 2: sdpa cannot soft-cap, and says so
        with pytest.raises(ConfigError, match='"sdpa" cannot soft-cap attention scores'):
            ours.set_attention(backend)
        return
    ours.set_attention(backend)
    tokens = random_tokens(len(fast), 2, T1)
    want = hf_logits(hf, tokens)[..., : len(fast)]
    with torch.inference_mode():
        got = ours(tokens)[..., : len(fast)]
    diff = float((got - want).abs().max())
    assert diff <= 1e-5, (family, backend, diff)
    assert float(want.abs().max()) > 0.5  # logits far from zero: the comparison means something
    if family == "gemma2":
        assert float(want.abs().max()) < 3.0  # the final soft-cap bounds them


# -- F2: packed documents -------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["sdpa", "eager", "flex"])
def test_f2_packed_documents_equal_each_alone(imported, backend):
    """Two documents in one row (positions restart, document_ids): each equals transformers on
    that document alone; the first is longer than the window."""
    family, hf, fast, _, ckpt, _ = imported
    ours = load_model(ckpt)[0]
    if backend == "sdpa" and ours.config.attn_softcap:
        pytest.skip("sdpa cannot soft-cap (test_f1 checks the refusal)")
    ours.set_attention(backend)
    lengths = (2 * W + 3, W + 1)
    docs = [random_tokens(len(fast), 1, n, seed=10 + i) for i, n in enumerate(lengths)]
    tokens = torch.cat(docs, 1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.inference_mode():
        got = ours(tokens, positions=positions, document_ids=document_ids)[..., : len(fast)]
    start = 0
    for doc, n in zip(docs, lengths):
        want = hf_logits(hf, doc)[..., : len(fast)]
        diff = float((got[:, start:start + n] - want).abs().max())
        assert diff <= 1e-5, (family, backend, n, diff)
        start += n


# -- F4: greedy decoding ----------------------------------------------------------------------------
def hf_generate(hf, ids: list[int], n: int) -> list[int]:
    """transformers' greedy `generate` for exactly n tokens (no stop id; its own KV cache)."""
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                          eos_token_id=None, pad_token_id=0, top_k=None, top_p=None, temperature=None)
    return out[0, len(ids):].tolist()


def test_f4_greedy_decode_equals_transformers_generate(imported):
    """2W + 8 new tokens through lmforge's KV cache and fused decode step: the window slides
    during decoding; two prompts of different lengths in one batch (left padding) too."""
    from lmforge.generate import SamplingConfig, generate

    family, hf, fast, _, ckpt, _ = imported
    ours, _, contract, _ = load_model(ckpt)
    n = 2 * W + 8
    prompts = [fast("Hello world, the quick")["input_ids"], fast("def add(a, b):")["input_ids"][:4]]
    want = [hf_generate(hf, p, n) for p in prompts]
    assert all(len(w) == n for w in want)
    cfg = SamplingConfig(max_new_tokens=n, greedy=True)
    for p, w in zip(prompts, want):
        assert generate(ours, [p], [], cfg, contract.pad_id)[0] == w, family
    assert generate(ours, prompts, [], cfg, contract.pad_id) == want, family


# -- F6: the round trip -------------------------------------------------------------------------------
#: config.json keys the exported folder must carry with the original's values
FAMILY_KEYS = {
    "gemma3": ["head_dim", "layer_types", "rope_parameters", "query_pre_attn_scalar", "hidden_activation",
               "tie_word_embeddings", "sliding_window", "final_logit_softcapping", "rms_norm_eps"],
    "gemma2": ["head_dim", "layer_types", "query_pre_attn_scalar", "hidden_activation", "tie_word_embeddings",
               "sliding_window", "attn_logit_softcapping", "final_logit_softcapping", "rms_norm_eps"],
    "olmo2": ["hidden_act", "tie_word_embeddings", "rms_norm_eps"],
    "mistral_sliding": ["sliding_window", "head_dim", "hidden_act", "tie_word_embeddings", "rms_norm_eps"],
    "granite": ["embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling", "hidden_act",
                "tie_word_embeddings", "rms_norm_eps"],
    "smollm3": ["no_rope_layers", "hidden_act", "tie_word_embeddings", "rms_norm_eps"],
    "phi3": ["sliding_window", "hidden_act", "tie_word_embeddings", "rms_norm_eps"],
    "phi3_sliding": ["sliding_window", "hidden_act", "tie_word_embeddings", "rms_norm_eps"],
}
COMMON_KEYS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "max_position_embeddings"]


def test_f6_round_trip(imported, tmp_path):
    family, hf, fast, src, ckpt, _ = imported
    model_type, arch = NAMES[family]
    out = export_hf(ckpt, tmp_path / "out", verify=True)  # verify: transformers' eager logits within 1e-4
    # tensors: bit-identical to transformers' own, under transformers' names
    theirs, ours = load_safetensors(src / "model.safetensors"), load_safetensors(out / "model.safetensors")
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    for name, t in theirs.items():
        got = ours[name]
        if name in ("model.embed_tokens.weight", "lm_head.weight") and got.shape[0] > t.shape[0]:
            got = got[: t.shape[0]]  # rows lmforge added for its own tokens (a pad)
        assert got.dtype == t.dtype and torch.equal(got, t), name
    # config.json: the family and its keys
    cfg = json.loads((out / "config.json").read_text())
    orig = json.loads((src / "config.json").read_text())
    assert cfg["model_type"] == model_type and cfg["architectures"] == [arch]
    for key in COMMON_KEYS + FAMILY_KEYS[family]:
        assert cfg[key] == orig[key], (key, cfg[key], orig[key])
    if family == "gemma3":
        assert cfg["hidden_activation"] == "gelu_pytorch_tanh" and cfg["tie_word_embeddings"] is True
        assert set(cfg["rope_parameters"]) == {"full_attention", "sliding_attention"}
        assert cfg["query_pre_attn_scalar"] == 40 and cfg["head_dim"] == 48
    # transformers loads it as the family, with equal logits
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").float().eval()
    assert type(again).__name__ == arch
    tokens = random_tokens(len(fast), 2, T1, seed=3)
    diff = float((hf_logits(again, tokens)[..., : len(fast)] - hf_logits(hf, tokens)[..., : len(fast)]).abs().max())
    assert diff <= 1e-6, (family, diff)
    # and imports back to the same lmforge model
    import_hf(out, tmp_path / "again")
    first, second = load_model(ckpt)[0].config, load_model(tmp_path / "again")[0].config
    assert dataclasses.replace(second, vocab_size=0) == dataclasses.replace(first, vocab_size=0)


def test_f6_names_are_the_familys_own():
    """`post_attention_layernorm` is Llama's norm before the MLP but Gemma's (and OLMo 2's) after
    attention; OLMo 2 has no norm before attention."""
    hf_name = "model.layers.2.post_attention_layernorm.weight"
    assert map_name("layers.2.ffn_norm.weight", family="llama") == hf_name
    assert map_name("layers.2.attention_post_norm.weight", family="gemma3_text") == hf_name
    assert map_name(hf_name, to_hf=False, family=RECORDS["olmo2"]) == "layers.2.attention_post_norm.weight"
    assert map_name("model.layers.2.pre_feedforward_layernorm.weight", to_hf=False, family="gemma2") == \
        "layers.2.ffn_norm.weight"
    with pytest.raises(ExportError, match="Olmo2ForCausalLM"):
        map_name("layers.0.attention_norm.weight", family="olmo2")
    with pytest.raises(ExportError, match="Gemma2ForCausalLM"):
        map_name("model.layers.0.self_attn.q_norm.weight", to_hf=False, family="gemma2")


# -- what import reads and refuses ---------------------------------------------------------------------
def source_folder(tmp_path_factory, family: str) -> Path:
    """hf_families' folder of `family`, built once for a module's fixture."""
    folder = tmp_path_factory.mktemp(f"{family}_src") / "hf"
    build_folder(family, folder)
    return folder


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory) -> Path:
    return source_folder(tmp_path_factory, "gemma3")


def test_older_gemma3_config_spelling_imports_to_the_same_model(gemma3_folder, tmp_path):
    """transformers 4.5x's Gemma 3 config: rope_theta + rope_local_base_freq and
    sliding_window_pattern instead of rope_parameters and layer_types."""
    import_hf(gemma3_folder, tmp_path / "new")
    old = edited(gemma3_folder, tmp_path / "old", rope_parameters=None, layer_types=None, _sliding_window_pattern=None,
                 rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6, rope_scaling=None)
    lines: list[str] = []
    import_hf(old, tmp_path / "out", log=lines.append)
    assert load_model(tmp_path / "out")[0].config == load_model(tmp_path / "new")[0].config
    assert any("sliding_window_pattern = 6" in x for x in lines)


def test_gemma3_softcaps_as_transformers_applies_them(gemma3_folder, tmp_path):
    """transformers' Gemma 3 never passes attn_logit_softcapping to its attention, and applies
    final_logit_softcapping: the import matches what transformers computes, and says so."""
    src = edited(gemma3_folder, tmp_path / "src", attn_logit_softcapping=1.0, final_logit_softcapping=2.5)
    lines: list[str] = []
    import_hf(src, tmp_path / "out", log=lines.append)
    ours = load_model(tmp_path / "out")[0]
    assert (ours.config.attn_softcap, ours.config.final_softcap) == (0.0, 2.5)
    assert any("attn_logit_softcapping = 1.0 is not applied" in x for x in lines)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(src), attn_implementation="eager").float().eval()
    tokens = random_tokens(ours.vocab_size, 2, T1)
    with torch.inference_mode():
        diff = float((ours(tokens) - hf(tokens).logits[..., : ours.vocab_size]).abs().max())
    assert diff <= 1e-5


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
     "model_type = 'gemma3'.*import the text model: Gemma3ForCausalLM"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]},
     r"architectures = \['Gemma3ForConditionalGeneration'\].*import the text model: Gemma3ForCausalLM"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_parameters.full_attention.rope_type = 'linear'"),
    ({"rope_parameters": None, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
      "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "rope_scaling.rope_type = 'linear'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "rope_parameters = .*per layer type"),
    ({"hidden_activation": "gelu"}, "hidden_activation = 'gelu', expected 'gelu_pytorch_tanh'"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types = .*7 entries"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention = True"),
    ({"query_pre_attn_scalar": -4}, "query_pre_attn_scalar = -4"),
])
def test_gemma3_refusals_name_the_field(gemma3_folder, tmp_path, changes, message):
    src = edited(gemma3_folder, tmp_path / "src", **changes)
    with pytest.raises(ExportError, match=message):
        import_hf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_gemma2_and_olmo2_rope_scaling_is_refused(tmp_path):
    build_folder("gemma2", tmp_path / "hf")
    scaled = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    src = edited(tmp_path / "hf", tmp_path / "src", rope_parameters=scaled)
    with pytest.raises(ExportError, match="rope_type = 'llama3'.*Gemma2ForCausalLM with plain RoPE"):
        import_hf(src, tmp_path / "out")


# -- what export refuses ---------------------------------------------------------------------------------
def test_export_refuses_what_no_family_carries(gemma3_folder, tmp_path):
    import_hf(gemma3_folder, tmp_path / "ckpt")
    model, _, contract, _ = load_model(tmp_path / "ckpt")
    cfg = model.config
    with pytest.raises(ExportError, match="model.family = 'gemma3_text': Gemma3ForCausalLM cannot carry this "
                                          "model's attn_softcap = 5.0"):  # the family imported, named
        hf_config(dataclasses.replace(cfg, attn_softcap=5.0), contract)
    with pytest.raises(ExportError, match="no model family lmforge exports carries"):  # Gemma 3 has no attention cap
        hf_config(dataclasses.replace(cfg, attn_softcap=5.0, qk_norm=True, family=""), contract)
    with pytest.raises(ExportError, match="model.embed_scale = 2.0.*sqrt\\(hidden_size\\) = 8.0"):
        hf_config(dataclasses.replace(cfg, embed_scale=2.0), contract)
    with pytest.raises(ExportError, match="model.rope_scaling = 'llama3'"):
        hf_config(dataclasses.replace(cfg, rope_scaling="llama3"), contract)
    mistral = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, qk_norm=False, layer_types=["sliding", "full"],
                          sliding_window=W)
    with pytest.raises(ExportError, match="MistralForCausalLM slides the window in every layer or in none"):
        hf_config(mistral, contract)
    assert hf_config(dataclasses.replace(mistral, layer_types=["sliding"] * 2), contract)["sliding_window"] == W


# -- Phi-3: fused weights split at import, joined at export; the family kept by model.family --------
@pytest.fixture(scope="module")
def phi3_folder(tmp_path_factory) -> Path:
    return source_folder(tmp_path_factory, "phi3")


@pytest.fixture(scope="module")
def phi3_ckpt(phi3_folder, tmp_path_factory) -> Path:
    return import_hf(phi3_folder, tmp_path_factory.mktemp("phi3_ckpt") / "ckpt")


def test_phi3_fused_weights_are_lmforges_parts(phi3_folder, phi3_ckpt):
    """qkv_proj rows = [wq; wk; wv] (H hd, KV hd, KV hd), gate_up_proj rows = [w1; w3]: the
    imported weights are those slices of transformers' own, bit for bit."""
    ours = load_safetensors(phi3_ckpt / "model.safetensors")
    theirs = load_safetensors(phi3_folder / "model.safetensors")
    qkv, gate_up = theirs["model.layers.1.self_attn.qkv_proj.weight"], theirs["model.layers.1.mlp.gate_up_proj.weight"]
    assert qkv.shape[0] == 4 * 16 + 2 * 2 * 16 and gate_up.shape[0] == 2 * 96
    assert torch.equal(ours["layers.1.attention.wq.weight"], qkv[:64])
    assert torch.equal(ours["layers.1.attention.wk.weight"], qkv[64:96])
    assert torch.equal(ours["layers.1.attention.wv.weight"], qkv[96:])
    assert torch.equal(ours["layers.1.feed_forward.w1.weight"], gate_up[:96])
    assert torch.equal(ours["layers.1.feed_forward.w3.weight"], gate_up[96:])
    assert not any("qkv" in k or "w13" in k for k in ours)


def test_model_family_picks_the_export_and_is_checked(phi3_ckpt):
    """model.family = "phi3" exports Phi3ForCausalLM; "" the first family carrying the mechanisms
    (Llama: the same computation); a name no record has, or a family that cannot carry the
    model, is refused naming model.family."""
    model, _, contract, _ = load_model(phi3_ckpt)
    cfg = model.config
    assert hf_config(cfg, contract)["architectures"] == ["Phi3ForCausalLM"]
    assert hf_config(dataclasses.replace(cfg, family=""), contract)["architectures"] == ["LlamaForCausalLM"]
    with pytest.raises(ExportError, match="model.family = 'phi4': expected one of 'llama'"):
        hf_config(dataclasses.replace(cfg, family="phi4"), contract)
    with pytest.raises(ExportError, match="model.family = 'phi3': Phi3ForCausalLM cannot carry this model's qk_norm"):
        hf_config(dataclasses.replace(cfg, qk_norm=True), contract)


@pytest.mark.parametrize("changes, message", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 5000.0, "short_factor": [1.0] * 8,
                          "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}}, "longrope"),
    ({"head_dim": 8}, "head_dim = 8 but hidden_size / num_attention_heads = 16"),
    ({"num_key_value_heads": 4}, r"model.layers.0.self_attn.qkv_proj.weight has shape \(128, 64\); expected 192 rows"),
])
def test_phi3_refusals_name_the_field(phi3_folder, tmp_path, changes, message):
    src = edited(phi3_folder, tmp_path / "src", **changes)
    with pytest.raises(ExportError, match=message):
        import_hf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
