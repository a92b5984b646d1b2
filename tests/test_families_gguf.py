"""GGUF export and import of the families beyond Llama: Gemma 3 (text), Gemma 2, OLMo 2
(MODEL-FAMILIES.md §10 items 7 and 8; issue #46). CPU, fp32, no llama.cpp (that is
tests/interop/test_llama_cpp_families.py, `make interop`).

F7 (export, read back with `gguf.GGUFReader`): the keys llama.cpp's converter writes (⊇ those of
the public Gemma 3 270M file), the architecture, key/value length = head_dim, the full layers'
RoPE base in rope.freq_base, the window; tensor names exactly gguf-py's MODEL_TENSORS[arch]
formatted by TENSOR_NAMES (no output when tied); every norm stored + 1 for Gemma only; q/k rows
as they are (no permutation); and each model llama.cpp cannot represent refused, naming the field.

F8 (import): GGUF -> lmforge gives the exported model back (norms - 1; the same logits), and the
GGUF import of a Hugging Face Gemma/OLMo 2 equals its `import-hf` tensor for tensor; a Gemma GGUF
without a chat template gets Gemma's, said in one log line.

The tiny models are built here (dim 64, head_dim 48 != 64 / 2 for Gemma, windows of 6 keys, every
norm weight random: Gemma's zero-initialised (1 + w) norms would hide an offset or shift bug).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract
from lmforge.export import ExportError
from lmforge.export.families import FAMILIES, GEMMA_CHAT_TEMPLATE, family_of
from lmforge.export.gguf import write_gguf
from lmforge.export.llama_cpp import gguf_arch
from lmforge.model import Transformer, load_model
from lmforge.model.io import model_state
from lmforge.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")

GEMMA = ("gemma3", "gemma2")
FAMS = ("gemma3", "gemma2", "olmo2")  # each also the name of its llama.cpp architecture
ARCH = {f: f for f in FAMS}
W = 6  # sliding window (keys)

#: The keys of the public Gemma 3 270M GGUF (gemma-3-270m-q4_k_m.gguf) that MODEL-FAMILIES.md §2.2
#: names: its 11 gemma3.* keys, the architecture, and its tokenizer keys. A file lmforge writes
#: has each of them (and more: rope.dimension_count, vocab_size, rope.freq_base_swa, the EOT id).
REAL_GEMMA3_KEYS = (
    "general.architecture",
    *(f"gemma3.{k}" for k in ("context_length", "embedding_length", "block_count", "feed_forward_length",
                              "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
                              "attention.key_length", "attention.value_length", "rope.freq_base",
                              "attention.sliding_window")),
    *(f"tokenizer.ggml.{k}" for k in ("model", "pre", "tokens", "scores", "token_type", "add_bos_token",
                                      "add_space_prefix", "bos_token_id", "eos_token_id", "unknown_token_id",
                                      "padding_token_id")),
)


def pattern(n: int, p: int) -> list[str]:
    """llama.cpp's `set_swa_pattern(p)` (and transformers' default layer_types) as lmforge's kinds."""
    return ["sliding" if i % p < p - 1 else "full" for i in range(n)]


def family_config(family: str, vocab: int, **overrides) -> ModelConfig:
    """A tiny lmforge ModelConfig of `family` as the issue describes it (Gemma: head_dim 48 != 64/2)."""
    common = dict(dim=64, ffn_dim=96, norm_eps=1e-6, max_seq_len=256, vocab_size=vocab)
    if family == "gemma3":
        cfg = ModelConfig(**common, n_layers=7, n_heads=2, n_kv_heads=1, head_dim=48, norm_offset=1.0,
                          norm_placement="sandwich", qk_norm=True, qk_norm_scope="head", mlp_activation="gelu_tanh",
                          embed_scale=64 ** 0.5, layer_types=pattern(7, 6), sliding_window=W, rope_theta=1e6,
                          rope_theta_sliding=1e4, tie_embeddings=True)
    elif family == "gemma2":
        cfg = ModelConfig(**common, n_layers=4, n_heads=2, n_kv_heads=1, head_dim=48, norm_offset=1.0,
                          norm_placement="sandwich", qk_norm=False, mlp_activation="gelu_tanh", embed_scale=64 ** 0.5,
                          layer_types=pattern(4, 2), sliding_window=W, rope_theta=1e4, attn_softcap=2.0,
                          final_softcap=3.0, tie_embeddings=True)
    elif family == "olmo2":
        cfg = ModelConfig(**common, n_layers=2, n_heads=4, n_kv_heads=2, norm_placement="post", qk_norm=True,
                          qk_norm_scope="projection", rope_theta=5e5, tie_embeddings=False)
    else:
        raise ValueError(family)
    return dataclasses.replace(cfg, **overrides)


def random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """Every weight random; Gemma's norms around 0 ((1 + w) form), OLMo 2's around 1."""
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 * torch.randn_like(p) if cfg.norm_offset else 1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    """family -> an lmforge tokenizer imported from the family's HF tokenizer (tests/hf_families.py:
    Gemma's SentencePiece-style BPE without a dummy prefix; OLMo 2's byte-level BPE)."""
    from hf_families import build_tokenizer

    from lmforge.tokenizer.foreign import import_tokenizer

    out = {}
    for family in ("gemma3", "olmo2"):
        root = tmp_path_factory.mktemp(f"tok-{family}")
        build_tokenizer(family, root / "hf")
        out[family] = import_tokenizer(root / "hf", root / "tok")
    out["gemma2"] = out["gemma3"]
    return out


@pytest.fixture(scope="module")
def exported(tokenizers, tmp_path_factory) -> dict:
    """family -> (model, tokenizer, f32 GGUF path)."""
    out = {}
    for family in FAMS:
        tok = tokenizers[family]
        model = random_model(family_config(family, tok.contract.vocab_size))
        path = tmp_path_factory.mktemp(f"gguf-{family}") / "m.gguf"
        write_gguf(path, model.config, tok.contract, model_state(model), tok.folder / "tokenizer.json")
        out[family] = (model, tok, path)
    return out


def read(path: Path) -> tuple[dict, dict]:
    """(keys -> values, tensor name -> ReaderTensor) of a GGUF file."""
    r = gguf.GGUFReader(str(path))
    return ({k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")},
            {t.name: t for t in r.tensors})


def array(t) -> np.ndarray:
    """A float32 ReaderTensor as a PyTorch-shaped (rows, cols) array."""
    return np.asarray(t.data).reshape([int(d) for d in reversed(t.shape.tolist())])


def expected_tensor_names(arch: str, n_layers: int, tied: bool) -> set[str]:
    """gguf-py's MODEL_TENSORS[arch] formatted by TENSOR_NAMES, + ".weight"; no output when tied."""
    member = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = set()
    for kind in gguf.MODEL_TENSORS[member]:
        if tied and kind == gguf.MODEL_TENSOR.OUTPUT:
            continue
        fmt = gguf.TENSOR_NAMES[kind] + ".weight"
        names.update(fmt.format(bid=i) for i in range(n_layers))  # a name without {bid} once
    return names


def test_every_family_record_is_llama_cpps():
    """Each family record with a GGUF form names an architecture whose runtime rules llama_cpp.py knows
    (LLAMA_CPP_ARCHS), only tensors gguf-py lists for that architecture, and an HF name for each of
    them (so import-gguf maps every tensor back); adding a family is its record and these checks."""
    from lmforge.export.gguf import LLAMA_CPP_ARCHS, gguf_tensor_names

    for f in FAMILIES.values():
        if f.gguf_arch is None:
            continue
        assert f.gguf_arch in LLAMA_CPP_ARCHS, f.model_type
        allowed = gguf_tensor_names(gguf, f.gguf_arch, 1)
        for ours, theirs in f.gguf_names:
            assert theirs.format(i=0).rsplit(".", 1)[0] in allowed, (f.model_type, theirs)
        assert {ours for ours, _ in f.gguf_names} <= {ours for ours, _ in f.hf_names}, f.model_type
        assert f.gguf_norm_shift == (1.0 if f.fixed.get("norm_offset") == 1.0 else 0.0), f.model_type
        # llama.cpp's converter permutes q/k rows for the architectures it converts as LlamaModel
        assert f.gguf_permute_qk is (f.gguf_arch in ("llama", "smollm3", "granite")), f.model_type


# -- F7: export -----------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMS)
def test_keys(exported, family):
    model, tok, path = exported[family]
    m, c = model.config, tok.contract
    kv, _ = read(path)
    a = ARCH[family]
    assert kv["general.architecture"] == a
    if family == "gemma3":
        missing = [k for k in REAL_GEMMA3_KEYS if k not in kv]
        assert not missing, missing
    hd = m.resolved_head_dim()
    assert kv[f"{a}.attention.key_length"] == kv[f"{a}.attention.value_length"] == hd
    assert kv[f"{a}.rope.dimension_count"] == hd
    assert kv[f"{a}.embedding_length"] == 64 and kv[f"{a}.block_count"] == m.n_layers
    assert kv[f"{a}.attention.head_count"] == m.n_heads and kv[f"{a}.attention.head_count_kv"] == m.n_kv_heads
    assert kv[f"{a}.feed_forward_length"] == 96 and kv[f"{a}.context_length"] == 256
    assert kv[f"{a}.rope.freq_base"] == pytest.approx(m.rope_theta)  # the full layers' base (Gemma 3: 1e6)
    assert kv[f"{a}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    if family in GEMMA:
        assert kv[f"{a}.attention.sliding_window"] == W
    else:
        assert f"{a}.attention.sliding_window" not in kv
    if family == "gemma3":
        assert kv["gemma3.rope.freq_base_swa"] == pytest.approx(1e4)
        assert not any("softcapping" in k for k in kv)
    if family == "gemma2":
        assert kv["gemma2.attn_logit_softcapping"] == pytest.approx(2.0)
        assert kv["gemma2.final_logit_softcapping"] == pytest.approx(3.0)
        assert "gemma2.rope.freq_base_swa" not in kv  # one base for every layer
    # the tokenizer: Gemma's as the real file has it (SentencePiece "llama", no dummy prefix, BOS prepended)
    T = gguf.TokenType
    if family in GEMMA:
        assert (kv["tokenizer.ggml.model"], kv["tokenizer.ggml.pre"]) == ("llama", "default")
        assert kv["tokenizer.ggml.add_space_prefix"] is False and kv["tokenizer.ggml.add_bos_token"] is True
        ids = {name: tok.hf.token_to_id(name) for name in ("<pad>", "<eos>", "<bos>", "<unk>", "<end_of_turn>")}
        assert (kv["tokenizer.ggml.padding_token_id"], kv["tokenizer.ggml.eos_token_id"],
                kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.unknown_token_id"]) == (0, 1, 2, 3)
        assert [ids[n] for n in ("<pad>", "<eos>", "<bos>", "<unk>")] == [0, 1, 2, 3]
        assert kv["tokenizer.ggml.eot_token_id"] == ids["<end_of_turn>"] == c.im_end_id
        assert kv["tokenizer.ggml.token_type"][ids["<end_of_turn>"]] == T.CONTROL
    assert kv["tokenizer.chat_template"] == c.chat_template
    assert len(kv["tokenizer.ggml.tokens"]) == kv[f"{a}.vocab_size"] == c.vocab_size


@pytest.mark.parametrize("family", FAMS)
def test_tensors(exported, family):
    """Names exactly gguf-py's for the architecture; values: + 1 on every norm for Gemma only, q/k
    rows as lmforge has them (no permutation), the embedding's padding rows sliced off."""
    model, tok, path = exported[family]
    m, V = model.config, tok.contract.vocab_size
    _, tensors = read(path)
    assert set(tensors) == expected_tensor_names(ARCH[family], m.n_layers, m.tie_embeddings)
    assert ("output.weight" in tensors) is (family == "olmo2")
    family_rec = next(f for f in FAMILIES.values() if f.gguf_arch == ARCH[family])
    to_gguf = dict(family_rec.gguf_names)
    state = model_state(model)
    shift = 1.0 if family in GEMMA else 0.0
    norms = 0
    for name, w in state.items():
        layer = name.split(".")[1] if name.startswith("layers.") else None
        key = name.replace(f"layers.{layer}.", "layers.{i}.") if layer else name
        t = tensors[to_gguf[key].format(i=layer)]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        got, want = array(t), w.detach().float().numpy()
        if name in ("tok_embeddings.weight", "output.weight"):
            want = want[:V]
        if name.endswith("norm.weight"):
            norms += 1
            np.testing.assert_array_equal(got, want + np.float32(shift), err_msg=name)
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)  # q/k included: not permuted
    n_norms = {"gemma3": 4 * 7 + 2 * 7 + 1, "gemma2": 4 * 4 + 1, "olmo2": 2 * 2 + 2 * 2 + 1}[family]
    assert norms == n_norms
    if family == "olmo2":  # QK-norm over the whole projection: n_heads * head_dim and n_kv_heads * head_dim
        assert array(tensors["blk.0.attn_q_norm.weight"]).shape == (4 * 16,)
        assert array(tensors["blk.0.attn_k_norm.weight"]).shape == (2 * 16,)
    if family == "gemma3":  # per head
        assert array(tensors["blk.0.attn_q_norm.weight"]).shape == (48,)
        assert array(tensors["blk.0.attn_q.weight"]).shape == (2 * 48, 64)


def test_gemma_tokenizer_as_google_saves_it(tokenizers, tmp_path):
    """Gemma's own tokenizer.json splits on " " after its normalizer has replaced every space by "▁"
    (pre_tokenizer Split(" ", MergedWithPrevious): it splits nothing). Export takes it as the same
    SentencePiece tokenizer without a dummy prefix: the same GGUF vocabulary, the same ids."""
    import json

    from tokenizers import Tokenizer as HFTokenizer

    from lmforge.export.gguf import gguf_vocab

    tok = tokenizers["gemma3"]
    tj = json.loads((tok.folder / "tokenizer.json").read_text(encoding="utf-8"))
    assert tj["pre_tokenizer"] is None and tj["normalizer"]["type"] == "Replace"
    tj["pre_tokenizer"] = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                           "invert": False}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    V = tok.contract.vocab_size
    ours, google = gguf_vocab(tok.folder / "tokenizer.json", V), gguf_vocab(tmp_path / "tokenizer.json", V)
    assert google == ours and google.add_space_prefix is False and (google.model, google.pre) == ("llama", "default")
    text = "  two  spaces\tdef f(x):\n    return x  # café 中文 "
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert hf.encode(text, add_special_tokens=False).ids == tok.hf.encode(text, add_special_tokens=False).ids
    tj["pre_tokenizer"]["pattern"] = {"String": "e"}  # a split that does split: refused
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    with pytest.raises(ExportError, match=r"pre_tokenizer = .*\"String\": \"e\""):
        gguf_vocab(tmp_path / "tokenizer.json", V)


def _gemma3(**kw):
    return "gemma3", kw


def _gemma2(**kw):
    return "gemma2", kw


def _olmo2(**kw):
    return "olmo2", kw


#: (family, overrides) -> what the refusal names
REFUSALS = [
    (_gemma3(layer_types=["sliding"] * 7), r"model\.layer_types = \['sliding'.*hard-codes which layers slide"),
    (_gemma3(layer_types=[], sliding_window=0), r"model\.layer_types = 'every layer full'.*il % 6 < 5"),
    (_gemma3(layer_types=pattern(7, 2)), r"model\.layer_types = .*expected \['sliding', 'sliding', 'sliding'"),
    (_gemma3(rope_theta_sliding=5e4), r"model\.rope_theta_sliding = 50000\.0: .*base 10000\.0 whatever"),
    (_gemma3(attn_scale=40 ** -0.5), r"model\.attn_scale = .*query_pre_attn_scalar = 40.*never reads"),
    (_gemma3(attn_softcap=50.0), r"model\.attn_softcap = 50\.0: llama\.cpp's gemma3 architecture never soft-caps"),
    (_gemma3(final_softcap=30.0), r"model\.final_softcap = 30\.0 with sliding layers: .*drops it"),
    (_gemma3(embed_scale=1.0), r"model\.embed_scale = 1\.0: .*sqrt\(dim\)"),
    (_gemma3(nope_layers=[3]), r"model\.nope_layers = \[3\]: llama\.cpp.s gemma3 architecture rotates"),
    (_gemma3(rope_scaling="llama3"), r"model\.rope_scaling = 'llama3'"),
    (_gemma2(layer_types=pattern(4, 6)), r"model\.layer_types = .*il % 2 < 1"),
    (_gemma2(attn_softcap=0.0), r"model\.attn_softcap = 0: llama\.cpp's gemma2 architecture always soft-caps"),
    (_gemma2(final_softcap=0.0), r"model\.final_softcap = 0: llama\.cpp's gemma2 architecture always soft-caps"),
    (_gemma2(tie_embeddings=False), r"model\.tie_embeddings = false: .*no output tensor"),
    (_gemma2(rope_theta_sliding=1e6), r"model\.rope_theta_sliding = 1000000\.0: .*one RoPE base"),
    (_olmo2(layer_types=["sliding", "full"], sliding_window=W),
     r"model\.layer_types = \['sliding', 'full'\].*olmo2 architecture has no sliding-window attention"),
    # Mistral with its window sliding: llama.cpp's llama never implemented it
    (("mistral", {}), r"model\.layer_types = .*llama\.cpp never implemented Mistral's sliding window"),
]


@pytest.mark.parametrize("case,match", REFUSALS, ids=[f"{c[0]}-{'-'.join(c[1]) or 'sliding'}" for c, _ in REFUSALS])
def test_refusals(tokenizers, tmp_path, case, match):
    """Each model llama.cpp would load and compute differently is refused before a file is written,
    naming the field, the value and why."""
    family, overrides = case
    if family == "mistral":
        cfg = dataclasses.replace(family_config("olmo2", 400), norm_placement="pre", qk_norm=False,
                                  layer_types=["sliding", "sliding"], sliding_window=W)
        assert family_of(cfg).model_type == "mistral"
    else:
        cfg = family_config(family, 400, **overrides)
    with pytest.raises(ExportError, match=match):
        gguf_arch(cfg)
    tok = tokenizers["gemma3"]
    model = Transformer(dataclasses.replace(cfg, vocab_size=tok.contract.vocab_size))
    with pytest.raises(ExportError, match=match):
        write_gguf(tmp_path / "x.gguf", model.config, tok.contract, model_state(model), tok.folder / "tokenizer.json")
    assert not (tmp_path / "x.gguf").exists()


def test_gemma_scale_of_27b_depth():
    """llama.cpp's Gemma 3 27B (62 layers) scales queries by 1/sqrt(dim / heads), not 1/sqrt(head_dim):
    a model of that depth exports only with that scale."""
    n = 62
    cfg = family_config("gemma3", 400, n_layers=n, layer_types=pattern(n, 6))
    with pytest.raises(ExportError, match=r"scales them by 0\.176777 \(1/sqrt\(32\)\)"):
        gguf_arch(cfg)
    assert gguf_arch(dataclasses.replace(cfg, attn_scale=32 ** -0.5)) == "gemma3"


# -- F8: import -----------------------------------------------------------------------------------
def _compare_models(original: Transformer, back: Transformer, V: int, family: str) -> None:
    """back = original: every tensor (Gemma's norms as float32 (w + 1) - 1, the others bit-equal;
    the embedding's first V rows), the mechanisms, and the logits."""
    a, b = original.config, back.config
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "norm_offset", "norm_placement", "qk_norm",
                "mlp_activation", "sliding_window", "attn_softcap", "final_softcap", "tie_embeddings", "nope_layers"):
        assert getattr(a, key) == getattr(b, key), key
    for key in ("residual_scale", "logit_scale"):  # GGUF keys are float32 (llama.cpp computes with those)
        assert np.float32(getattr(a, key)) == np.float32(getattr(b, key)), key
    assert a.qk_norm_scope == b.qk_norm_scope or not a.qk_norm
    assert a.resolved_head_dim() == b.resolved_head_dim() and a.resolved_ffn_dim() == b.resolved_ffn_dim()
    assert [a.is_sliding(i) for i in range(a.n_layers)] == [b.is_sliding(i) for i in range(b.n_layers)]
    assert (b.rope_theta, b.rope_theta_sliding or b.rope_theta) == (a.rope_theta, a.rope_theta_sliding or a.rope_theta)
    hd = a.resolved_head_dim()
    # to float32's precision: Granite's scales are the file's float32 keys (Gemma's are derived, exact)
    assert np.float32(a.attn_scale or hd ** -0.5) == np.float32(b.attn_scale or hd ** -0.5)
    assert np.float32(a.embed_scale) == np.float32(b.embed_scale)
    sa, sb = model_state(original), model_state(back)
    assert sa.keys() == sb.keys()
    one = torch.tensor(1.0 if family in GEMMA else 0.0)
    for k in sa:
        x, y = sa[k].float(), sb[k].float()
        if k in ("tok_embeddings.weight", "output.weight"):
            x, y = x[:V], y[:V]
        if k.endswith("norm.weight"):
            x = (x + one) - one  # float32 arithmetic: the GGUF holds 1 + w
        assert torch.equal(x, y), k
    ids = torch.randint(0, V, (2, 3 * W + 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids), original(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMS)
def test_import_gives_the_model_back(exported, family, tmp_path):
    """import-gguf of the exported file: the same model (norms - 1 for Gemma, no un-permutation),
    the same contract, the same token ids."""
    from lmforge.export import import_gguf

    model, tok, path = exported[family]
    back = import_gguf(path, tmp_path / "back")
    got = load_model(back)[0]
    _compare_models(model, got, tok.contract.vocab_size, family)
    c, d = tok.contract, Contract.load(back)
    for key in ("special_tokens", "vocab_size", "add_bos", "chat_template"):
        assert getattr(c, key) == getattr(d, key), key
    texts = ["def add(a, b):\n    return a + b", " leading space", "café <end_of_turn> 12345", ""]
    assert [Tokenizer.load(back).encode(t) for t in texts] == [tok.encode(t) for t in texts]


def test_gemma_without_chat_template(exported, tmp_path, monkeypatch):
    """A Gemma GGUF without tokenizer.chat_template (the public Gemma 3 270M file has none) is
    imported with Gemma's template (families.GEMMA_CHAT_TEMPLATE), said in one log line; its turns
    end with <end_of_turn>, which becomes the chat stop token."""
    import lmforge.export.gguf as mod
    from lmforge.export import import_gguf

    model, tok, _ = exported["gemma3"]
    keys = mod.tokenizer_keys
    monkeypatch.setattr(mod, "tokenizer_keys",
                        lambda c, v: {k: x for k, x in keys(c, v).items() if k != "chat_template"})
    path = write_gguf(tmp_path / "bare.gguf", model.config, tok.contract, model_state(model),
                      tok.folder / "tokenizer.json")
    kv, _ = read(path)
    assert "tokenizer.chat_template" not in kv
    lines: list[str] = []
    back = import_gguf(path, tmp_path / "back", log=lines.append)
    said = [line for line in lines if line.startswith("chat template:")]  # one line, naming the file
    assert len(said) == 1 and f"{path} has none" in said[0] and "Gemma3ForCausalLM's chat template" in said[0], lines
    c = Contract.load(back)
    assert c.chat_template == GEMMA_CHAT_TEMPLATE
    assert c.im_end_id == tok.hf.token_to_id("<end_of_turn>")
    rendered = Tokenizer.load(back).render_chat([{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert Tokenizer.load(back).decode(rendered.ids) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n")


def _rewritten(path: Path, out: Path, edit) -> Path:
    """A copy of GGUF `path` with its keys changed by `edit(dict)` (tensors as they are)."""
    r = gguf.GGUFReader(str(path))
    kv = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.") and k != "general.architecture"}
    w = gguf.GGUFWriter(str(out), r.fields["general.architecture"].contents())
    values = {k: (f.contents(), f.types) for k, f in kv.items()}
    edit(values)
    for k, (v, types) in values.items():
        if types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(k, v)
        else:
            w.add_key_value(k, v, types[0])
    for t in r.tensors:
        w.add_tensor(t.name, array(t))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return out


def test_gemma_end_of_turn_typed_normal(exported, tmp_path):
    """llama.cpp's converter wrote Gemma's <end_of_turn> as a NORMAL token, with no eot_token_id and
    (the public 270M file) no chat template; llama.cpp's loader makes it a control token by its
    spelling. import-gguf does the same: <end_of_turn> is special, the chat stop token, and a chat
    renders to the ids of the exported model's tokenizer."""
    from lmforge.export import import_gguf

    model, tok, path = exported["gemma3"]
    eot = tok.hf.token_to_id("<end_of_turn>")

    def as_converted(kv):
        types = list(kv["tokenizer.ggml.token_type"][0])
        assert types[eot] == gguf.TokenType.CONTROL
        types[eot] = int(gguf.TokenType.NORMAL)
        kv["tokenizer.ggml.token_type"] = (types, kv["tokenizer.ggml.token_type"][1])
        del kv["tokenizer.ggml.eot_token_id"], kv["tokenizer.chat_template"]

    edited = _rewritten(path, tmp_path / "converted.gguf", as_converted)
    kv, _ = read(edited)
    assert kv["tokenizer.ggml.token_type"][eot] == gguf.TokenType.NORMAL and "tokenizer.ggml.eot_token_id" not in kv
    back = import_gguf(edited, tmp_path / "back")
    c = Contract.load(back)
    assert c.im_end_id == eot and c.chat_template == GEMMA_CHAT_TEMPLATE
    talk = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    ours = Tokenizer.load(back).render_chat(talk)
    assert ours.ids.count(eot) == 2
    assert Tokenizer.load(back).encode("text <end_of_turn>") == tok.encode("text <end_of_turn>")  # plain text there


IMPORT_REFUSALS = [
    ("gemma3", lambda kv: kv.update({"gemma3.rope.freq_base_swa": (5e4, [gguf.GGUFValueType.FLOAT32])}),
     r"gemma3\.rope\.freq_base_swa = 50000\.0: llama\.cpp's gemma3 rotates the sliding layers with base 10000\.0"),
    ("gemma3", lambda kv: kv.pop("gemma3.attention.sliding_window"), r"no gemma3\.attention\.sliding_window"),
    ("gemma3", lambda kv: kv.update({"gemma3.final_logit_softcapping": (30.0, [gguf.GGUFValueType.FLOAT32])}),
     r"gemma3\.final_logit_softcapping = 30\.0: .*drops the final soft-cap"),
    ("olmo2", lambda kv: kv.update({"olmo2.attention.sliding_window": (4, [gguf.GGUFValueType.UINT32])}),
     r"olmo2\.attention\.sliding_window = 4"),
    ("gemma2", lambda kv: kv.update({"gemma2.rope.scaling.type": ("linear", [gguf.GGUFValueType.STRING]),
                                     "gemma2.rope.scaling.factor": (8.0, [gguf.GGUFValueType.FLOAT32])}),
     r"gemma2\.rope\.scaling\.type = 'linear'"),
]


@pytest.mark.parametrize("family,edit,match", IMPORT_REFUSALS)
def test_import_refusals(exported, tmp_path, family, edit, match):
    """A file whose keys say something llama.cpp ignores (or lmforge cannot hold) is refused, naming the key."""
    from lmforge.export import import_gguf

    path = _rewritten(exported[family][2], tmp_path / "edited.gguf", edit)
    with pytest.raises(ExportError, match=match):
        import_gguf(path, tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_rewritten_file_imports(exported, tmp_path):
    """The copy `_rewritten` makes without an edit imports (the refusals above are the edits')."""
    from lmforge.export import import_gguf

    path = _rewritten(exported["gemma3"][2], tmp_path / "same.gguf", lambda kv: None)
    assert load_model(import_gguf(path, tmp_path / "back"))[0].config.layer_types == pattern(7, 6)


# -- F8: GGUF import = HF import, from a transformers folder -------------------------------------------
#: tests/hf_families.py's tiny models, with what llama.cpp can represent: query_pre_attn_scalar =
#: head_dim (llama.cpp scales by 1/sqrt(head_dim), never by the config's scalar)
HF_OVERRIDES = {"gemma3": {"query_pre_attn_scalar": 48}, "gemma2": {"query_pre_attn_scalar": 48}, "olmo2": {},
                "smollm3": {}, "granite": {}, "phi3": {}}
ARCH["smollm3"] = "smollm3"  # SmolLM3: llama.cpp's smollm3 skips RoPE in every 4th layer, as transformers' default
ARCH["granite"] = "granite"  # Granite: its four scalars are the file's keys
ARCH["phi3"] = "phi3"  # Phi-3: fused attn_qkv and ffn_up (2 x ffn rows), NeoX rotation (no permutation)


@pytest.mark.parametrize("family", FAMS + ("smollm3", "granite", "phi3"))
def test_gguf_import_equals_hf_import(family, tmp_path):
    """transformers folder -> import-hf -> export --format gguf -> import-gguf: tensor for tensor the
    import-hf checkpoint (Gemma norms through float32 1 + w), the same config and contract, and
    logits equal to transformers' own on the folder."""
    pytest.importorskip("transformers")
    from hf_families import build_folder

    from lmforge.export import export_gguf, import_gguf
    from lmforge.export.hf_in import import_hf

    hf, fast = build_folder(family, tmp_path / "hf", **HF_OVERRIDES[family])
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    out = export_gguf(ckpt, tmp_path / "m.gguf")
    kv, _ = read(out)
    assert kv["general.architecture"] == ARCH[family]
    back = import_gguf(out, tmp_path / "back")
    ours, theirs = load_model(ckpt)[0], load_model(back)[0]
    V = Contract.load(ckpt).vocab_size
    _compare_models(ours, theirs, V, family)
    c, d = Contract.load(ckpt), Contract.load(back)
    for key in ("special_tokens", "vocab_size", "add_bos", "chat_template"):
        assert getattr(c, key) == getattr(d, key), key
    ids = torch.randint(0, len(fast), (1, 3 * W + 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0, :, : len(fast)]
        got = theirs(ids)[0, :, : len(fast)]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_phi3_tensors_are_llama_cpps_fused_ones(tmp_path):
    """Phi-3's GGUF holds attn_qkv = [q; k; v] and ffn_up = [gate; up] (2 x ffn rows, no ffn_gate),
    as llama.cpp's converter writes them, bit for bit transformers' qkv_proj and gate_up_proj,
    unpermuted (llama.cpp's phi3 rotates NeoX halves)."""
    pytest.importorskip("transformers")
    from hf_families import build_folder

    from lmforge.export import export_gguf
    from lmforge.export.hf_in import import_hf

    hf, _ = build_folder("phi3", tmp_path / "hf")
    out = export_gguf(import_hf(tmp_path / "hf", tmp_path / "ckpt"), tmp_path / "m.gguf")
    _, tensors = read(out)
    assert not any(n.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight")) for n in tensors)
    for i in range(2):
        qkv, up = array(tensors[f"blk.{i}.attn_qkv.weight"]), array(tensors[f"blk.{i}.ffn_up.weight"])
        assert qkv.shape == (4 * 16 + 2 * 2 * 16, 64) and up.shape == (2 * 96, 64)
        layer = hf.model.layers[i]
        assert np.array_equal(qkv, layer.self_attn.qkv_proj.weight.detach().numpy())
        assert np.array_equal(up, layer.mlp.gate_up_proj.weight.detach().numpy())


def test_general_name_says_phi3_exactly_when_the_specials_strip(tmp_path):
    """llama.cpp strips the spaces after special tokens iff general.name holds "phi3" / "phi-3" (its
    rule for Phi-3's tokenizer, whose specials have rstrip = true); the format has no per-token flag.
    Export writes a name that agrees with the tokenizer: a Phi-3 tokenizer in a folder of any name
    gets "(phi3)", another tokenizer in a folder named after Phi-3 gets "phi 3"; import-gguf gives a
    phi3-named file's specials rstrip, so lmforge tokenizes the chat as llama.cpp does; a tokenizer
    whose stripping is not llama.cpp's set is refused, leaving no file."""
    pytest.importorskip("transformers")
    import json as _json

    from hf_families import build_folder

    from lmforge.export import export_gguf, import_gguf
    from lmforge.export.hf_in import import_hf
    from lmforge.tokenizer import Tokenizer

    build_folder("phi3", tmp_path / "hf")
    path = export_gguf(import_hf(tmp_path / "hf", tmp_path / "run" / "ckpt"), tmp_path / "p.gguf")
    kv, _ = read(path)
    assert kv["general.name"] == "run (phi3)"
    back = import_gguf(path, tmp_path / "back")
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    ours, again = Tokenizer.load(tmp_path / "run" / "ckpt"), Tokenizer.load(back)
    assert again.render_chat(chat).ids == ours.render_chat(chat).ids
    ids, user, newline = ours.render_chat(chat).ids, ours.hf.token_to_id("<|user|>"), ours.encode("\n")
    assert ids[ids.index(user) + 1:ids.index(user) + 1 + len(newline)] != newline  # the "\n" after <|user|> is stripped
    build_folder("smollm3", tmp_path / "hf3")
    plain = export_gguf(import_hf(tmp_path / "hf3", tmp_path / "my-Phi-3-run" / "ckpt"), tmp_path / "s.gguf")
    assert read(plain)[0]["general.name"] == "my-Phi 3-run"
    bad = tmp_path / "bad"
    build_folder("phi3", bad)
    tj = _json.loads((bad / "tokenizer.json").read_text())
    for added in tj["added_tokens"]:
        added["rstrip"] = added["content"] == "<|end|>"
    (bad / "tokenizer.json").write_text(_json.dumps(tj))
    ckpt = import_hf(bad, tmp_path / "bad-ckpt")
    with pytest.raises(ExportError, match=r"added tokens \['<\|end\|>'\] strip the spaces after them.*llama.cpp does only "
                                          r"for Phi-3"):
        export_gguf(ckpt, tmp_path / "b.gguf")
    assert not (tmp_path / "b.gguf").exists()


def test_phi3_file_window_is_not_applied_as_llama_cpp_does(tmp_path):
    """llama.cpp's converter writes Phi-3-mini-4k's sliding_window (2047) and its runtime does not
    apply it ("Phi SWA is currently disabled"): import-gguf reads such a file as full attention,
    as llama.cpp computes it, and says so; the same key in a llama file is refused."""
    pytest.importorskip("transformers")
    from hf_families import build_folder

    from lmforge.export import export_gguf, import_gguf
    from lmforge.export.hf_in import import_hf

    build_folder("phi3", tmp_path / "hf")
    path = export_gguf(import_hf(tmp_path / "hf", tmp_path / "ckpt"), tmp_path / "m.gguf")
    windowed = _rewritten(path, tmp_path / "w.gguf", lambda kv: kv.__setitem__(
        "phi3.attention.sliding_window", (6, [gguf.GGUFValueType.UINT32])))
    lines: list[str] = []
    back = load_model(import_gguf(windowed, tmp_path / "back", log=lines.append))[0]
    assert back.config.layer_types == [] and back.config.family == "phi3"
    assert any("phi3.attention.sliding_window = 6: llama.cpp does not apply it" in x for x in lines)


@pytest.mark.parametrize("family,match", [
    ("mistral_sliding", r"model\.layer_types = \['sliding'.*llama\.cpp never implemented Mistral's sliding window"),
    ("smollm3_nope_1", r"model\.nope_layers = \[1\]: llama\.cpp's smollm3 architecture skips RoPE in every 4th layer"
                       r".*expected \[3\]"),
    ("gemma3", r"model\.attn_scale = .*query_pre_attn_scalar = 40.*never reads query_pre_attn_scalar"),
    ("phi3_sliding", r"model\.layer_types = \['sliding'.*llama\.cpp disables Phi-3's sliding window"),
])
def test_imported_models_llama_cpp_cannot_run_are_refused(family, match, tmp_path):
    """From transformers folders: a Mistral whose window slides (llama.cpp's llama has none) and a
    Gemma 3 with query_pre_attn_scalar 40 != head_dim 48 (llama.cpp scales by 1/sqrt(head_dim)) and
    a SmolLM3 whose NoPE layer is not llama.cpp's every 4th import, and `export --format gguf`
    refuses them, leaving no file."""
    pytest.importorskip("transformers")
    from hf_families import build_folder

    from lmforge.export import export_gguf
    from lmforge.export.hf_in import import_hf

    if family == "smollm3_nope_1":  # SmolLM3 with layer 1 the NoPE one: llama.cpp's smollm3 hard-codes layer 3
        build_folder("smollm3", tmp_path / "hf", no_rope_layers=[1, 0, 1, 1])
    else:
        build_folder(family, tmp_path / "hf")
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    with pytest.raises(ExportError, match=match):
        export_gguf(ckpt, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()
