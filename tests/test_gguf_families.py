"""GGUF export of imported models: each tokenizer family mapped to llama.cpp's tokenizer by what
it is (tokenizer.json's structure), read back with `gguf.GGUFReader`; no llama.cpp needed.

A folder as `save_pretrained` writes it is built here for each family (a tokenizer trained on
part of the standard library with HF `tokenizers`, a tiny random `LlamaForCausalLM`), imported
with `lmforge import-hf` and exported with `lmforge export --format gguf`. Checked: the tokenizer
model and pre-tokenizer, every token, type, merge and score, the special-token keys against the
contract, and that llama.cpp's SentencePiece merge rule (re-stated below in a few lines of
Python) gives HF's ids under the exported scores. Bad tokenizers are refused, by what was seen.
That llama.cpp itself computes the same ids, logits and greedy tokens is proven in
tests/interop/test_llama_cpp_families.py (`make interop`).
"""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

import pytest
import torch

from gguf_helpers import FAMILIES, hf_family_folder
from lmforge.contract import Contract
from lmforge.export import ExportError, export_gguf
from lmforge.export.gguf import gguf_vocab
from lmforge.export.gguf_vocab import GPT2_PATTERN, LLAMA3_PATTERN
from lmforge.export.hf_in import import_hf
from lmforge.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

#: family -> (tokenizer.ggml.model, tokenizer.ggml.pre)
EXPECTED = {"gpt2": ("gpt2", "gpt-2"), "smollm": ("gpt2", "smollm"), "llama3": ("gpt2", "llama-bpe"),
            "qwen2": ("gpt2", "qwen2"), "spm": ("llama", "default")}


def training_texts() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.name[0] < "d" and p.stat().st_size < 100_000)
    return [p.read_text(encoding="utf-8", errors="replace") for p in files][:40]


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, Path]:
    """family -> an lmforge checkpoint imported from its HF folder (SmolLM2-like: tied)."""
    texts = training_texts()
    out = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(family)
        hf = hf_family_folder(root / "hf", family, texts, tie=family == "smollm")
        out[family] = import_hf(hf, root / "ckpt")
    return out


def fields(path: Path) -> dict:
    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}, {t.name for t in r.tensors}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_metadata(imported, family, tmp_path):
    ckpt = imported[family]
    contract = Contract.load(ckpt)
    kv, tensors = fields(export_gguf(ckpt, tmp_path / "m.gguf"))
    model, pre = EXPECTED[family]
    assert (kv["tokenizer.ggml.model"], kv["tokenizer.ggml.pre"]) == (model, pre)

    tj = json.loads((ckpt / "tokenizer.json").read_text(encoding="utf-8"))
    V = contract.vocab_size
    vocab = {i: t for t, i in tj["model"]["vocab"].items()} | {a["id"]: a["content"] for a in tj["added_tokens"]}
    assert kv["tokenizer.ggml.tokens"] == [vocab[i] for i in range(V)]
    T = gguf.TokenType
    special = {a["id"] for a in tj["added_tokens"] if a["special"]}
    unk = tj["model"]["vocab"].get(tj["model"].get("unk_token"))

    def token_type(i):
        if i == unk:
            return T.UNKNOWN
        if i in special:
            return T.CONTROL
        return T.BYTE if model == "llama" and vocab[i].startswith("<0x") and len(vocab[i]) == 6 else T.NORMAL

    assert kv["tokenizer.ggml.token_type"] == [token_type(i) for i in range(V)]
    merges = [" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]]
    if model == "gpt2":
        assert kv["tokenizer.ggml.merges"] == merges and "tokenizer.ggml.scores" not in kv
        assert "tokenizer.ggml.add_space_prefix" not in kv and "tokenizer.ggml.unknown_token_id" not in kv
    else:
        first = {}
        for r, m in enumerate(merges):
            first.setdefault(m.replace(" ", ""), r)
        assert kv["tokenizer.ggml.scores"] == [pytest.approx(-first.get(vocab[i], -0.0)) for i in range(V)]
        assert "tokenizer.ggml.merges" not in kv
        assert kv["tokenizer.ggml.add_space_prefix"] is True and kv["tokenizer.ggml.unknown_token_id"] == unk
        assert sum(t == T.BYTE for t in kv["tokenizer.ggml.token_type"]) == 256

    ids = contract.special_tokens
    assert kv["tokenizer.ggml.bos_token_id"] == (ids["eos"] if ids.get("bos") is None else ids["bos"])
    for name, key in (("eos", "eos_token_id"), ("pad", "padding_token_id"), ("im_end", "eot_token_id")):
        present = ids.get(name) is not None and not (name == "im_end" and ids["im_end"] == ids["eos"])
        assert kv.get(f"tokenizer.ggml.{key}") == (ids[name] if present else None), key
    assert kv["tokenizer.ggml.eos_token_id"] == ids["eos"]
    assert kv["tokenizer.ggml.add_bos_token"] is contract.add_bos
    assert kv["tokenizer.ggml.add_eos_token"] is False
    assert kv["tokenizer.chat_template"] == contract.chat_template
    assert kv["llama.vocab_size"] == V
    assert ("output.weight" in tensors) is (family != "smollm")  # tied: llama.cpp reuses token_embd


# -- llama.cpp's SentencePiece merge rule, re-stated (src/llama-vocab.cpp, llm_tokenizer_spm_session) --
def spm_tokenize(text: str, tokens: list[str], scores: list[float], add_space_prefix: bool) -> list[int]:
    """Symbols = the characters of " "+text with spaces as "▁"; repeatedly merge the adjacent pair
    whose concatenation is the highest-scoring token (leftmost on ties); a final symbol that is not
    a token is split back along the merges that made it, or emitted as <0xNN> byte tokens."""
    if not text:
        return []
    ids = {t: i for i, t in enumerate(tokens)}
    text = ((" " if add_space_prefix else "") + text).replace(" ", "\u2581")
    syms = list(text)
    made: dict[str, tuple[str, str]] = {}
    while True:
        best = None
        for k in range(len(syms) - 1):
            t = syms[k] + syms[k + 1]
            if t in ids and (best is None or scores[ids[t]] > best[0]):
                best = (scores[ids[t]], k)
        if best is None:
            break
        k = best[1]
        made[syms[k] + syms[k + 1]] = (syms[k], syms[k + 1])
        syms[k:k + 2] = [syms[k] + syms[k + 1]]
    out: list[int] = []

    def emit(s: str) -> None:
        if s in ids:
            out.append(ids[s])
        elif s in made:
            emit(made[s][0]), emit(made[s][1])
        else:
            out.extend(ids[f"<0x{b:02X}>"] for b in s.encode("utf-8"))

    for s in syms:
        emit(s)
    return out


def adversarial_strings(n: int = 300) -> list[str]:
    rng = random.Random(0)
    root = Path(sysconfig.get_paths()["stdlib"])
    held_out = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.glob("*.py"))
                if p.name[0] >= "m" and p.stat().st_size < 100_000][:60]
    out = ["", " ", "  ", "\n", "a", " a", "  a  ", "\t\tx", "\"\"\"\"\"", "▁", "▁▁ ▁", "<s>", "</s>", "<unk>",
           "<0x41>", "café 中文 🎉", "x²+y³", "'s 're", "12345 6789", "e\u0301", "\u00a0\u3000"]
    for _ in range(n):
        t = rng.choice(held_out)
        start = rng.randrange(len(t))
        out.append(t[start:start + rng.choice([1, 3, 10, 40, 200])])
    return out


def test_spm_scores_reproduce_hf_ids(imported):
    """Under the exported scores, llama.cpp's merge rule gives HF's ids on held-out code and odd
    strings; with every token scored equally (what llama.cpp's own converter writes for an
    HF-only tokenizer, LlamaHfVocab: -1000) it does not."""
    ckpt = imported["spm"]
    tok = Tokenizer.load(ckpt)
    v = gguf_vocab(ckpt / "tokenizer.json", tok.vocab_size)
    strings = adversarial_strings()
    bad = [(s, tok.encode(s), spm_tokenize(s, v.tokens, v.scores, v.add_space_prefix)) for s in strings
           if tok.encode(s) != spm_tokenize(s, v.tokens, v.scores, v.add_space_prefix)]
    assert not bad, f"{len(bad)} of {len(strings)} differ; first: {bad[:2]}"
    flat = [-1000.0] * len(v.tokens)
    assert sum(tok.encode(s) != spm_tokenize(s, v.tokens, flat, True) for s in strings) > len(strings) // 4


# -- refusals: each names what it saw --------------------------------------------------------------
def edited(ckpt: Path, tmp: Path, edit) -> Path:
    tj = json.loads((ckpt / "tokenizer.json").read_text(encoding="utf-8"))
    edit(tj)
    path = tmp / "tokenizer.json"
    path.write_text(json.dumps(tj), encoding="utf-8")
    return path


def _set(key, value):
    def edit(tj):
        tj[key] = value
    return edit


def _model(key, value):
    def edit(tj):
        tj["model"][key] = value
    return edit


def _split_regex(pattern):
    def edit(tj):
        tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = pattern
    return edit


def _drop_merge(tj):  # a split of a token that is no longer a rule
    merges = tj["model"]["merges"]
    counts = {}
    for m in merges:
        counts["".join(m)] = counts.get("".join(m), 0) + 1
    victim = next(i for i, m in enumerate(merges) if counts["".join(m)] > 1)
    del merges[victim]


def _swap_groups(tj):  # a later token's rule moved before an earlier one's
    merges = tj["model"]["merges"]
    merges.insert(0, merges.pop(len(merges) // 2))


def _drop_byte(tj):
    del tj["model"]["vocab"]["<0x41>"]


def _lstrip(tj):
    tj["added_tokens"][-1]["lstrip"] = True


def _twin(tj):  # a model token renamed to an added token's spelling: two ids, one text
    vocab = tj["model"]["vocab"]
    victim = max(vocab, key=vocab.get)
    vocab[tj["added_tokens"][-1]["content"]] = vocab.pop(victim)
    tj["model"]["merges"] = [m for m in tj["model"]["merges"] if "".join(m) != victim]


BYTE_LEVEL_REFUSALS = [
    ("qwen2", _model("type", "Unigram"), r"model\.type = 'Unigram'"),
    ("qwen2", _model("dropout", 0.1), r"model\.dropout = 0\.1"),
    ("qwen2", _set("normalizer", {"type": "NFC"}), r"normalizer = \{\"type\": \"NFC\"\}.*does not normalize"),
    ("qwen2", _model("ignore_merges", True), r"model\.ignore_merges = true.*llama-bpe"),
    ("qwen2", _split_regex(r"\w+|\s+"), r"pre_tokenizer = .*\\\\w\+.*implements no byte-level pre-tokenizer"),
    ("gpt2", _set("pre_tokenizer", {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                    "use_regex": True}), r"\"add_prefix_space\": true"),
    ("gpt2", _set("pre_tokenizer", {"type": "Whitespace"}), r"pre_tokenizer = \{\"type\": \"Whitespace\"\}"),
    ("llama3", _split_regex(GPT2_PATTERN), r"implements no byte-level pre-tokenizer"),
    ("llama3", _set("decoder", {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always",
                                "split": True}), r"decoder = .*Metaspace.*expected a ByteLevel decoder"),
    ("qwen2", _lstrip, r"added token .* has lstrip = true"),
]
SPM_REFUSALS = [
    ("spm", _set("normalizer", {"type": "NFKC"}), r"normalizer = \{\"type\": \"NFKC\"\}.*SentencePiece"),
    ("spm", lambda tj: (tj.update(normalizer=None, pre_tokenizer={
        "type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False})),
     r"prepend_scheme\": \"first\".*differs on text that starts with a space"),
    ("spm", _model("ignore_merges", True), r"ignore_merges = true with byte_fallback"),
    ("spm", _drop_byte, r"256 byte tokens|1 byte tokens are missing \(first <0x41>\)"),
    ("spm", _drop_merge, r"splits into .* which is not a merge rule"),
    ("spm", _swap_groups, r"must be grouped by the token they make"),
    ("spm", _twin, r"ids \d+ and \d+ are both spelled"),
]


@pytest.mark.parametrize("family,edit,match", BYTE_LEVEL_REFUSALS + SPM_REFUSALS,
                         ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BYTE_LEVEL_REFUSALS + SPM_REFUSALS)])
def test_refused_with_what_was_seen(imported, tmp_path, family, edit, match):
    ckpt = imported[family]
    V = Contract.load(ckpt).vocab_size
    path = edited(ckpt, tmp_path, edit)
    with pytest.raises(ExportError, match=match) as info:
        gguf_vocab(path, V)
    assert str(path) in str(info.value) and "--format hf" in str(info.value)


def test_llama3_regex_without_ignore_merges_is_smaug(imported, tmp_path):
    """Same regex, merges always applied: llama.cpp's smaug-bpe, not llama-bpe."""
    ckpt = imported["llama3"]
    v = gguf_vocab(edited(ckpt, tmp_path, _model("ignore_merges", False)), Contract.load(ckpt).vocab_size)
    assert (v.model, v.pre) == ("gpt2", "smaug-bpe")
    split = json.loads((ckpt / "tokenizer.json").read_text(encoding="utf-8"))["pre_tokenizer"]["pretokenizers"][0]
    assert split["pattern"]["Regex"] == LLAMA3_PATTERN


def test_long_tokens_are_written_as_they_are(imported, tmp_path):
    """llama.cpp has no limit on a token's length (Llama 3's vocabulary has tokens of 100+ bytes)."""
    ckpt = imported["qwen2"]

    def long_token(tj):
        vocab = tj["model"]["vocab"]
        victim = max(vocab, key=vocab.get)
        vocab["Ġ" * 64] = vocab.pop(victim)
        tj["model"]["merges"] = [m for m in tj["model"]["merges"] if "".join(m) != victim]

    v = gguf_vocab(edited(ckpt, tmp_path, long_token), Contract.load(ckpt).vocab_size)
    assert "Ġ" * 64 in v.tokens


# -- the import families (tests/hf_families.py): architecture, Llama 3.1 RoPE scaling, Qwen2 biases --
IMPORT_FAMILIES = {"smollm": "llama", "llama3": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


@pytest.fixture(scope="module")
def imported_models(tmp_path_factory) -> dict:
    """family -> (HF model, lmforge checkpoint) for each family of tests/hf_families.py."""
    from hf_families import build_folder

    out = {}
    for family in IMPORT_FAMILIES:
        root = tmp_path_factory.mktemp(f"imp-{family}")
        model, _ = build_folder(family, root / "hf")
        out[family] = (model, import_hf(root / "hf", root / "ckpt"))
    return out


@pytest.mark.parametrize("family", list(IMPORT_FAMILIES))
def test_import_family_architecture(imported_models, family, tmp_path):
    import numpy as np
    from hf_families import TOKENIZERS

    hf, ckpt = imported_models[family]
    contract = Contract.load(ckpt)
    out = export_gguf(ckpt, tmp_path / "m.gguf")
    r = gguf.GGUFReader(str(out))
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    t = {x.name: np.asarray(x.data) for x in r.tensors}
    arch = IMPORT_FAMILIES[family]
    assert kv["general.architecture"] == arch
    assert kv["tokenizer.chat_template"] == TOKENIZERS[family][3] == contract.chat_template  # the model's own
    assert kv["tokenizer.ggml.add_bos_token"] is (TOKENIZERS[family][2] is not None) is contract.add_bos
    assert ("output.weight" in t) is (family != "smollm")  # tied: llama.cpp reuses token_embd
    assert ("rope_freqs.weight" in t) is (family == "llama3")
    if family == "llama3":  # each frequency's divisor, against transformers' own llama3 inverse frequencies
        hd = hf.config.hidden_size // hf.config.num_attention_heads
        plain = 1.0 / (5000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        want = (plain / hf.model.rotary_emb.inv_freq.double()).float().numpy()
        np.testing.assert_allclose(t["rope_freqs.weight"], want, rtol=1e-6)
        assert want.max() > 1.5  # the scaling is on: a mapping that ignored it would fail
    if family == "qwen2":  # q/k/v biases, unpermuted (qwen2 rotates half-split, as HF does)
        for i in range(hf.config.num_hidden_layers):
            for proj, name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v")):
                want = getattr(hf.model.layers[i].self_attn, proj).bias.detach().numpy()
                np.testing.assert_array_equal(t[f"blk.{i}.{name}.bias"], want)
    else:
        assert not any(name.endswith(".bias") for name in t)


def test_qk_norm_with_biases_refused(imported_models):
    import dataclasses

    from lmforge.export.llama_cpp import gguf_arch
    from lmforge.model import load_model

    m = load_model(imported_models["qwen2"][1])[0].config
    with pytest.raises(ExportError, match=r"qk_norm = true with model\.qkv_bias = true"):
        gguf_arch(dataclasses.replace(m, qk_norm=True))
    with pytest.raises(ExportError, match=r"rope_scaling = 'llama3' with model\.qkv_bias"):
        gguf_arch(dataclasses.replace(m, rope_scaling="llama3"))


# -- import-gguf: back from GGUF ----------------------------------------------------------------------
def _round_trip(ckpt: Path, tmp: Path, dtype: str = "float32") -> Path:
    from lmforge.export import import_gguf

    return import_gguf(export_gguf(ckpt, tmp / f"m-{dtype}.gguf", dtype=dtype), tmp / f"back-{dtype}")


def _same_checkpoint(a: Path, b: Path, strings: list[str]) -> float:
    """Contracts equal but for the tokenizer file's hash; the same ids on `strings`; returns the
    largest weight difference."""
    from lmforge.model import load_model

    ca, cb = Contract.load(a), Contract.load(b)
    for field in ("special_tokens", "vocab_size", "model_vocab_size", "add_bos", "chat_template", "token_dtype"):
        assert getattr(ca, field) == getattr(cb, field), field
    ta, tb = Tokenizer.load(a), Tokenizer.load(b)
    assert [ta.encode(s) for s in strings] == [tb.encode(s) for s in strings]
    sa, sb = load_model(a)[0].state_dict(), load_model(b)[0].state_dict()
    assert sa.keys() == sb.keys()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_gguf_round_trip(imported, family, tmp_path):
    """export --format gguf then import-gguf: the same checkpoint (weights bit-equal in f32, the
    same contract and ids): the tokenizer is rebuilt from the file's vocabulary, merges or scores."""
    assert _same_checkpoint(imported[family], _round_trip(imported[family], tmp_path), adversarial_strings(120)) == 0.0


@pytest.mark.parametrize("family", ["smollm", "mistral", "qwen2", "qwen3"])
def test_import_gguf_round_trip_import_families(imported_models, family, tmp_path):
    ckpt = imported_models[family][1]
    assert _same_checkpoint(ckpt, _round_trip(ckpt, tmp_path), adversarial_strings(60)) == 0.0


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_import_gguf_dequantizes(imported, tmp_path, monkeypatch, qtype):
    """A file whose 2-D weights are `qtype` imports as exactly gguf's dequantization of them."""
    import numpy as np

    import lmforge.export.gguf as mod
    from lmforge.model import load_model

    Q = gguf.GGMLQuantizationType[qtype]
    monkeypatch.setattr(mod, "_encode", lambda g, a, name, dtype: (a.astype(np.float32), None) if a.ndim == 1
                        else (g.quants.quantize(a, Q), Q))
    ckpt = imported["qwen2"]
    back = _round_trip(ckpt, tmp_path, "q8_0")
    r = gguf.GGUFReader(str(tmp_path / "m-q8_0.gguf"))
    assert {t.tensor_type.name for t in r.tensors if len(t.shape) == 2} == {qtype}
    original, imported_back = load_model(ckpt)[0].state_dict(), load_model(back)[0].state_dict()
    V = Contract.load(ckpt).vocab_size
    w = original["layers.0.feed_forward.w1.weight"].numpy()
    want = gguf.quants.dequantize(gguf.quants.quantize(w, Q), Q)
    np.testing.assert_array_equal(imported_back["layers.0.feed_forward.w1.weight"].numpy(), want)
    emb = original["tok_embeddings.weight"][:V].numpy()
    np.testing.assert_array_equal(imported_back["tok_embeddings.weight"][:V].numpy(),
                                  gguf.quants.dequantize(gguf.quants.quantize(emb, Q), Q))


def test_import_gguf_refusals(imported_models, tmp_path):
    from lmforge.export import import_gguf

    ckpt = imported_models["llama3"][1]
    out = export_gguf(ckpt, tmp_path / "l3.gguf")
    with pytest.raises(ExportError, match=r"tensor 'rope_freqs\.weight' has no lmforge counterpart"):
        import_gguf(out, tmp_path / "back")
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    w.add_tensor("token_embd.weight", __import__("numpy").zeros((4, 8), "float32"))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ExportError, match=r"general\.architecture = 'phi2'; lmforge imports llama, qwen2, qwen3"):
        import_gguf(tmp_path / "phi.gguf", tmp_path / "back")
    assert not (tmp_path / "back").exists()
