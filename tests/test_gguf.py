"""GGUF export (`lmforge export --format gguf`), read back with `gguf.GGUFReader`.

Every key and every tensor's name, shape and type is checked against the checkpoint; bad
input (a pre-tokenizer llama.cpp lacks, a normalizer, a model option llama.cpp lacks, an
existing --out) is refused with a message; an interrupted export leaves nothing behind.
That llama.cpp computes the same thing is proven in tests/interop/ (`make interop`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.cli import main
from lmforge.config import ModelConfig
from lmforge.fileio import OutputError
from lmforge.export import ExportError, export_gguf
from lmforge.export.gguf import _permute_rope_rows, gguf_tensors, gguf_vocab, write_gguf
from lmforge.export.llama_cpp import gguf_arch
from lmforge.tokenizer import CHAT_TEMPLATE
from lmforge.model import load_model
from lmforge.model.io import model_state

gguf = pytest.importorskip("gguf")

from gguf_helpers import make_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tiny_corpus, tiny_tokenizer) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("gguf"), tiny_corpus, tiny_tokenizer)


def fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def test_every_key_and_tensor(ckpt, tiny_tokenizer, tmp_path):
    out = export_gguf(ckpt, tmp_path / "m.gguf")
    model, cfg, contract, _ = load_model(ckpt)
    m = model.config
    V = contract.vocab_size
    assert contract.model_vocab_size > V  # the fixture has padding rows to slice off
    r = gguf.GGUFReader(str(out))
    kv = fields(r)
    tj = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = {i: t for t, i in tj["model"]["vocab"].items()} | {a["id"]: a["content"] for a in tj["added_tokens"]}
    T = gguf.TokenType
    expected = {
        "general.architecture": "llama", "general.name": "run", "general.file_type": 0,
        "general.tags": ["lmforge"],  # export.card.gguf_facts: this bare checkpoint has no run chain to describe
        "general.quantization_version": gguf.GGML_QUANT_VERSION,
        "llama.context_length": m.max_seq_len, "llama.embedding_length": m.dim, "llama.block_count": m.n_layers,
        "llama.feed_forward_length": m.resolved_ffn_dim(), "llama.attention.head_count": m.n_heads,
        "llama.attention.head_count_kv": m.n_kv_heads, "llama.attention.key_length": m.resolved_head_dim(),
        "llama.attention.value_length": m.resolved_head_dim(), "llama.rope.dimension_count": m.resolved_head_dim(),
        "llama.rope.freq_base": pytest.approx(5000.0), "llama.attention.layer_norm_rms_epsilon": pytest.approx(1e-6),
        "llama.vocab_size": V,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": [vocab[i] for i in range(V)],
        "tokenizer.ggml.token_type": [T.CONTROL if i in contract.special_tokens.values() else T.NORMAL for i in range(V)],
        "tokenizer.ggml.merges": [" ".join(p) for p in tj["model"]["merges"]],
        "tokenizer.ggml.bos_token_id": contract.bos_id, "tokenizer.ggml.eos_token_id": contract.eos_id,
        "tokenizer.ggml.eot_token_id": contract.im_end_id, "tokenizer.ggml.padding_token_id": contract.pad_id,
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    assert kv == expected

    state = model_state(model)
    want = {"token_embd.weight": state["tok_embeddings.weight"][:V], "output_norm.weight": state["norm.weight"],
            "output.weight": state["output.weight"][:V]}
    names = {"attention_norm": "attn_norm", "attention.wq": "attn_q", "attention.wk": "attn_k",
             "attention.wv": "attn_v", "attention.wo": "attn_output", "ffn_norm": "ffn_norm",
             "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down"}
    for i in range(m.n_layers):
        for ours, theirs in names.items():
            t = state[f"layers.{i}.{ours}.weight"]
            if ours == "attention.wq":
                t = torch.from_numpy(_permute_rope_rows(t.numpy(), m.n_heads))
            if ours == "attention.wk":
                t = torch.from_numpy(_permute_rope_rows(t.numpy(), m.n_kv_heads))
            want[f"blk.{i}.{theirs}.weight"] = t
    got = {t.name: t for t in r.tensors}
    assert set(got) == set(want)
    for name, t in got.items():
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
        assert list(t.shape) == list(reversed(want[name].shape)), name  # GGUF lists dims innermost first
        np.testing.assert_array_equal(np.asarray(t.data).reshape(want[name].shape), want[name].numpy(), err_msg=name)


def test_rope_permutation_interleaves_halves():
    hd, H = 8, 2
    w = np.arange(H * hd)[:, None].astype(np.float32)  # row r holds r
    p = _permute_rope_rows(w, H)[:, 0]
    # per head: rows (0, 4, 1, 5, 2, 6, 3, 7): pair j = (x_j, x_{j+hd/2}) of the half-split layout
    assert p.tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]


@pytest.mark.parametrize("dtype,kind", [("float16", "F16"), ("bfloat16", "BF16"), ("q8_0", "Q8_0")])
def test_dtypes(ckpt, tmp_path, dtype, kind):
    out = export_gguf(ckpt, tmp_path / "m.gguf", dtype=dtype)
    r = gguf.GGUFReader(str(out))
    ref = {t.name: t for t in gguf.GGUFReader(str(export_gguf(ckpt, tmp_path / "f32.gguf"))).tensors}
    for t in r.tensors:
        want = "F32" if t.name.endswith("norm.weight") else kind
        assert t.tensor_type.name == want, t.name
        assert list(t.shape) == list(ref[t.name].shape), t.name
        back = gguf.quants.dequantize(t.data, t.tensor_type)
        a = np.asarray(ref[t.name].data, dtype=np.float32).reshape(back.shape)
        assert np.abs(back - a).max() <= 0.01 * np.abs(a).max() + 1e-6, t.name
    ftype = {"float16": 1, "bfloat16": 32, "q8_0": 7}[dtype]
    assert r.fields["general.file_type"].contents() == ftype


def test_tied_embeddings_have_no_output_tensor(tmp_path, tiny_corpus, tiny_tokenizer):
    ck = make_checkpoint(tmp_path, tiny_corpus, tiny_tokenizer, **{"model.tie_embeddings": "true"})
    r = gguf.GGUFReader(str(export_gguf(ck, tmp_path / "m.gguf")))
    names = {t.name for t in r.tensors}
    assert "token_embd.weight" in names and "output.weight" not in names


def test_qk_norm_maps_to_qwen3(ckpt, tmp_path):
    """A model with QK-norm (model.qk_norm, when the model has the option) is llama.cpp's qwen3:
    q/k norm tensors, half-split RoPE kept (no permutation)."""
    model, cfg, contract, path = load_model(ckpt)
    m = dataclasses.replace(model.config, qk_norm=True)
    state = model_state(model)
    hd = m.resolved_head_dim()
    for i in range(m.n_layers):
        state[f"layers.{i}.attention.q_norm.weight"] = torch.full((hd,), 1.5)
        state[f"layers.{i}.attention.k_norm.weight"] = torch.full((hd,), 0.5)
    assert gguf_arch(m) == "qwen3"
    out = write_gguf(tmp_path / "q.gguf", m, contract, state, path / "tokenizer.json")
    r = gguf.GGUFReader(str(out))
    kv = fields(r)
    assert kv["general.architecture"] == "qwen3" and kv["qwen3.attention.head_count"] == m.n_heads
    t = {x.name: x for x in r.tensors}
    assert list(t["blk.1.attn_q_norm.weight"].shape) == [hd] and list(t["blk.1.attn_k_norm.weight"].shape) == [hd]
    np.testing.assert_array_equal(np.asarray(t["blk.0.attn_q.weight"].data).reshape(m.dim, m.dim),
                                  state["layers.0.attention.wq.weight"].numpy())  # not permuted
    # without the option, those weights have no home in the llama mapping: refused, by name
    with pytest.raises(ExportError, match="q_norm"):
        gguf_tensors(state, model.config, contract.vocab_size, "llama")


def test_unknown_model_option_refused(ckpt):
    model = load_model(ckpt)[0]

    @dataclasses.dataclass
    class Fancy(ModelConfig):
        logit_softcap: float = 0.0

    m = Fancy(**{f.name: getattr(model.config, f.name) for f in dataclasses.fields(ModelConfig)}, logit_softcap=30.0)
    with pytest.raises(ExportError, match=r"model\.logit_softcap = 30\.0"):
        gguf_arch(m)
    assert gguf_arch(dataclasses.replace(m, logit_softcap=0.0)) == "llama"  # an option at its default is fine


def _edited_tokenizer(ckpt: Path, tmp: Path, edit) -> Path:
    path = tmp / "tokenizer.json"
    tj = json.loads((ckpt / "tokenizer.json").read_text())
    edit(tj)
    path.write_text(json.dumps(tj))
    return path


def test_other_pre_tokenizer_refused(ckpt, tmp_path, tiny_tokenizer):
    V = tiny_tokenizer.vocab_size

    def gpt2(tj):  # another pre-tokenizer llama.cpp knows: mapped by what it is (tests/test_gguf_families.py)
        tj["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}

    assert gguf_vocab(_edited_tokenizer(ckpt, tmp_path, gpt2), V).pre == "gpt-2"

    def other_regex(tj):
        tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\w+|\s+"

    with pytest.raises(ExportError, match="pre_tokenizer"):
        gguf_vocab(_edited_tokenizer(ckpt, tmp_path, other_regex), V)

    def normalizer(tj):
        tj["normalizer"] = {"type": "NFC"}

    with pytest.raises(ExportError, match="normalizer"):
        gguf_vocab(_edited_tokenizer(ckpt, tmp_path, normalizer), V)

    def ignore_merges(tj):
        tj["model"]["ignore_merges"] = True

    with pytest.raises(ExportError, match="ignore_merges"):
        gguf_vocab(_edited_tokenizer(ckpt, tmp_path, ignore_merges), V)


def test_existing_out_refused_unless_force(ckpt, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"precious")
    with pytest.raises(OutputError, match="already exists; it is left untouched. Pass --force"):
        export_gguf(ckpt, out)
    assert out.read_bytes() == b"precious"
    assert main(["export", "--checkpoint", str(ckpt), "--format", "gguf", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["export", "--checkpoint", str(ckpt), "--format", "gguf", "--out", str(out), "--force",
                 "--dtype", "q8_0"]) == 0
    assert gguf.GGUFReader(str(out)).fields["general.file_type"].contents() == 7
    with pytest.raises(OutputError, match="is a folder"):
        export_gguf(ckpt, tmp_path)
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf"), "--dtype", "q8_0"]) == 2
    assert "--format gguf" in capsys.readouterr().err


def test_interrupted_export_leaves_nothing(ckpt, tmp_path, monkeypatch):
    import lmforge.export.gguf as mod

    real = gguf.GGUFWriter.write_tensors_to_file

    def boom(self, *a, **k):
        real(self, *a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", boom)
    with pytest.raises(KeyboardInterrupt):
        mod.export_gguf(ckpt, tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []
    # and a replaced file survives a failed --force export untouched
    (tmp_path / "m.gguf").write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        mod.export_gguf(ckpt, tmp_path / "m.gguf", force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"] and (tmp_path / "m.gguf").read_bytes() == b"old"


def test_vocab_gap_is_unused_placeholder(ckpt, tmp_path, tiny_tokenizer):
    V = tiny_tokenizer.vocab_size

    def gap(tj):
        vocab = tj["model"]["vocab"]
        victim = [t for t, i in vocab.items() if i == V - 1][0]
        del vocab[victim]
        tj["model"]["merges"] = [m for m in tj["model"]["merges"] if "".join(m) != victim]

    v = gguf_vocab(_edited_tokenizer(ckpt, tmp_path, gap), V)
    assert v.tokens[V - 1] == f"[PAD{V - 1}]" and v.token_types[V - 1] == gguf.TokenType.UNUSED


def test_cli_help_lists_format(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = capsys.readouterr().out
    assert "--format {hf,gguf,peft}" in text and "q8_0" in text and "--force" in text


def test_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(["export", "--checkpoint", str(tmp_path / "nope"), "--format", "gguf",
                 "--out", str(tmp_path / "m.gguf")]) == 2
    assert "nope" in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()
    shutil.rmtree(tmp_path, ignore_errors=True)
