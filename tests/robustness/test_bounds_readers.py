"""Bounds for every number of the config, and the readers' last holes: refused cleanly, nothing changed.

- Every int and float field of every config section has a row in `lmforge.config.BOUNDS`;
  a value past either end is a ConfigError naming the field, the value, the range and the
  default (one parametrized row per bound), and the value at each end is accepted.
- SFT conversation records whose fields have the wrong JSON type at any depth (a role that
  is a list, content that is a number or an object, a message that is a string, messages
  that is an object, nested nulls, a ShareGPT `from` that is a list, an integer too long
  to read): the file-and-line error, exit 2, every file unchanged.
- `eval` on a split with no documents is refused (naming the data folder and the split).
- Export never writes a non-finite value: a weight of 1e6 is refused for float16 (GGUF and
  HF, naming the tensor and the range); q8_0 holds it (its float16 block scale is 1e6 / 127)
  and the file read back with `gguf.GGUFReader` is finite; 1e7 is refused for q8_0. The
  range check is exact at the float16, q8_0 and bfloat16 limits.
The command-line rows run through the robustness table's own runner (test_bad_inputs.py).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import test_bad_inputs as table
from test_bad_inputs import C, SFT_SETS, Row, project, write  # noqa: F401  (project: a fixture)

from lmforge.config import BOUNDS, MAX_STEPS, SECTION_TYPES, field_types, load_config
from lmforge.errors import ConfigError
from lmforge.export.hf import ExportError, check_dtype_range


# -- bounds ---------------------------------------------------------------------------------------
def test_every_number_of_the_config_has_a_bound():
    numeric = {f"{s}.{k}" for s, cls in SECTION_TYPES.items() for k, t in field_types(cls).items()
               if t in (int, float)}
    assert numeric == set(BOUNDS), numeric ^ set(BOUNDS)


def _beyond(name: str) -> list:
    low, high, low_open, high_open = BOUNDS[name]
    is_int = isinstance(low, int) and isinstance(high, int)
    over = high if high_open else (high + 1 if is_int else high * 2 + 1)
    under = low if low_open else (low - 1 if is_int else low - 0.5 if low == 0 else low / 2)
    return [over, under]


def _sets(name: str, value) -> list[str]:
    sets = [f"{name}={value!r}"]
    if name == "data.seq_len":  # seq_len past model.max_seq_len is refused by its own (older) check first
        sets.append(f"model.max_seq_len={1 << 24}")
    if name == "train.context_parallel" and value > 1:  # and seq_len must split into 2 x context_parallel chunks
        sets += [f"data.seq_len={2 * value}", f"model.max_seq_len={2 * value}"]
    return sets


CASES = [(n, v) for n in BOUNDS for v in _beyond(n)]


@pytest.mark.parametrize("name,value", CASES, ids=[f"{n}={v}" for n, v in CASES])
def test_a_number_past_its_bound_is_refused(name, value):
    with pytest.raises(ConfigError) as exc:
        load_config(None, _sets(name, value))
    msg = str(exc.value)
    shown = repr(float(value)) if isinstance(BOUNDS[name][0], float) else repr(value)
    assert f"{name} = {shown}" in msg or f"{name} = {value}" in msg, msg


NEW_UPPER = ["train.steps", "train.checkpoint_every", "train.eval_every", "train.keep_last", "train.grad_accum_steps",
             "train.warmup_steps", "train.log_every", "train.eval_tokens", "train.time_limit_s", "train.lr",
             "train.weight_decay", "train.grad_clip", "train.muon_lr_scale", "train.muon_ns_steps",
             "train.embed_lr_scale", "train.head_lr_scale", "train.global_batch_size", "train.micro_batch_size",
             "sft.steps", "sft.warmup_steps", "sft.max_examples", "sft.lr", "model.n_layers", "model.max_seq_len",
             "model.ffn_dim", "model.rope_theta", "model.norm_eps", "tokenizer.max_train_bytes",
             "generate.max_new_tokens", "generate.temperature", "generate.top_k"]


@pytest.mark.parametrize("name", NEW_UPPER)
def test_the_message_names_field_value_range_and_default(name):
    low, high, low_open, high_open = BOUNDS[name]
    value = _beyond(name)[0]
    section, key = name.split(".")
    default = getattr(SECTION_TYPES[section](), key)
    want = (f"{name} = {value!r}: expected {low} {'<' if low_open else '<='} value {'<' if high_open else '<='} "
            f"{high} (default {default!r}).")
    with pytest.raises(ConfigError, match="^" + re.escape(want) + "$"):
        load_config(None, [f"{name}={value!r}"])


@pytest.mark.parametrize("name,value,range_", [
    ("train.muon_momentum", 1.0, r"0\.0 <= value < 1\.0"), ("train.muon_momentum", -0.1, r"0\.0 <= value < 1\.0"),
    ("train.muon_ns_steps", 0, r"1 <= value <= 100"), ("train.muon_lr_scale", -1.0, r"0\.0 < value <= 100\.0"),
    ("train.head_lr_scale", 1e3, r"0\.0 < value <= 100\.0"),
])
def test_muon_settings_are_bounded(name, value, range_):
    with pytest.raises(ConfigError, match=re.escape(f"{name} = {value!r}: expected ") + range_ + r" \(default"):
        load_config(None, [f"{name}={value!r}"])


def test_the_ends_of_each_range_are_accepted():
    cfg = load_config(None, [f"train.steps={MAX_STEPS}", f"train.warmup_steps={MAX_STEPS}", "train.keep_last=1000000",
                             "train.muon_momentum=0.0", "train.muon_ns_steps=100", "train.muon_lr_scale=100.0",
                             "train.weight_decay=1.0", "train.lr=10.0", "train.time_limit_s=1e8"])
    assert cfg.train.steps == MAX_STEPS and cfg.train.muon_ns_steps == 100


# -- the command line (the table's runner): exit 2, one error line, nothing changed ----------------
ROWS: list[Row] = []
PRETRAIN = ("pretrain", *C, "--out", "newrun", "--no-progress")
for rid, s, m in [
    ("steps-huge", "train.steps=1000000000", r"train\.steps = 1000000000: expected 1 <= value <= 100000000 \(default 600\)"),
    ("checkpoint-every-huge", "train.checkpoint_every=10000000000", r"train\.checkpoint_every = 10000000000: expected 0 <="),
    ("keep-last-huge", "train.keep_last=99999999", r"train\.keep_last = 99999999: expected 0 <= value <= 1000000"),
    ("accum-huge", "train.grad_accum_steps=1000000", r"train\.grad_accum_steps = 1000000: expected 1 <= value <= 65536"),
    ("warmup-huge", "train.warmup_steps=200000000", r"train\.warmup_steps = 200000000"),
    ("eval-every-huge", "train.eval_every=200000000", r"train\.eval_every = 200000000"),
    ("muon-momentum-1", "train.muon_momentum=1.0", r"train\.muon_momentum = 1\.0: expected 0\.0 <= value < 1\.0 \(default 0\.95\)"),
    ("muon-lr-scale", "train.muon_lr_scale=1e9", r"train\.muon_lr_scale = 1000000000\.0: expected 0\.0 < value <= 100\.0"),
]:
    ROWS.append(Row(f"bound-{rid}", ("pretrain", "--set", s, *PRETRAIN[1:]), m))
SFT = ("sft", *C, *SFT_SETS, "--set", "sft.data=bad.jsonl", "--out", "newsft", "--no-progress")
GOOD = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
USER, ASSISTANT = {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}
for rid, record, m in [
    ("role-list", {"messages": [{"role": ["user"], "content": "x"}, ASSISTANT]}, r"message 0 has role \['user'\]"),
    ("role-object", {"messages": [{"role": {"name": "user"}, "content": "x"}, ASSISTANT]}, r"message 0 has role \{"),
    ("role-null", {"messages": [{"role": None, "content": "x"}, ASSISTANT]}, r"message 0 has role None"),
    ("content-number", {"messages": [USER, {"role": "assistant", "content": 3.5}]},
     r"message 1 \(assistant\) content is 3\.5; expected a string"),
    ("content-object", {"messages": [{"role": "user", "content": {"text": "x"}}, ASSISTANT]},
     r"message 0 \(user\) content is \{'text': 'x'\}; expected a string"),
    ("content-list-of-nulls", {"messages": [{"role": "user", "content": [None, None]}, ASSISTANT]},
     r"message 0 \(user\) content is \[None, None\]"),
    ("content-null", {"messages": [USER, {"role": "assistant", "content": None}]}, r"message 1 \(assistant\) content is None"),
    ("message-string", {"messages": ["hello", ASSISTANT]}, r"message 0 has no \"role\" \(keys: str\)"),
    ("message-null", {"messages": [USER, None]}, r"message 1 has no \"role\" \(keys: NoneType\)"),
    ("message-list", {"messages": [[USER], ASSISTANT]}, r"message 0 has no \"role\" \(keys: list\)"),
    ("messages-object", {"messages": {"0": USER}}, r"\"messages\" must be a non-empty list"),
    ("messages-null", {"messages": None}, r"\"messages\" must be a non-empty list.*got None"),
    ("messages-string", {"messages": "hi"}, r"\"messages\" must be a non-empty list"),
    ("sharegpt-from-list", {"conversations": [{"from": ["human"], "value": "x"}, {"from": "gpt", "value": "y"}]},
     r"turn 0 has \"from\" = \['human'\]"),
    ("sharegpt-from-object", {"conversations": [{"from": {"a": 1}, "value": "x"}, {"from": "gpt", "value": "y"}]},
     r"turn 0 has \"from\" = \{'a': 1\}"),
    ("sharegpt-value-object", {"conversations": [{"from": "human", "value": {"a": None}}, {"from": "gpt", "value": "y"}]},
     r"message 0 \(user\) content is \{'a': None\}"),
    ("sharegpt-turns-object", {"conversations": {"from": "human"}}, r"\"conversations\" must be a non-empty list"),
    ("sharegpt-turn-null", {"conversations": [None]}, r"turn 0 has no \"from\" \(keys: NoneType\)"),
    ("alpaca-instruction-list", {"instruction": ["x"], "output": "y"}, r"Alpaca field \"instruction\" is \['x'\]"),
    ("alpaca-input-number", {"instruction": "x", "input": 4, "output": "y"}, r"Alpaca field \"input\" is 4"),
]:
    ROWS.append(Row(f"sftdata-deep-{rid}", SFT, r"bad\.jsonl:2: " + m,
                    write("bad.jsonl", GOOD + "\n" + json.dumps(record) + "\n")))
ROWS.append(Row("sftdata-deep-int-too-long", SFT, r"bad\.jsonl:2: a value cannot be read \(Exceeds the limit",
                write("bad.jsonl", GOOD + '\n{"messages": ' + "7" * 5000 + "}\n")))


def _empty_val(p: Path) -> None:
    (p / "data" / "val.bin").write_bytes(b"")
    (p / "data" / "val.idx").write_bytes(np.zeros(1, dtype=np.int64).tobytes())


ROWS.append(Row("eval-empty-split", ("eval", "--checkpoint", "run"),
                r"data folder data: split 'val' holds 0 documents and no token to predict", _empty_val))
ROWS.append(Row("eval-empty-split-json-out", ("eval", "--checkpoint", "run", "--out", "eval.json"),
                r"data folder data: split 'val' holds 0 documents", _empty_val))


def _scale_one_weight(value: float):
    def f(p: Path) -> None:
        from safetensors.torch import load_file, save_file

        path = p / "run" / "step_000002" / "model.safetensors"
        state = load_file(str(path))
        state["layers.0.attention.wq.weight"][0, 0] = value  # one weight far outside float16
        save_file(state, str(path))
    return f


GGUF = ("export", "--checkpoint", "run", "--format", "gguf", "--out", "m.gguf")
HF = ("export", "--checkpoint", "run", "--out", "newhf")
ROWS += [
    Row("gguf-f16-1e6", (*GGUF, "--dtype", "float16"),
        r"weight 'blk\.0\.attn_q\.weight' holds a value of magnitude 1e\+06, beyond what float16 stores "
        r"\(\|x\| <= 65504\): it would be written as infinity\. Export with --dtype bfloat16 or float32",
        _scale_one_weight(1e6)),
    Row("gguf-q8-1e7", (*GGUF, "--dtype", "q8_0"),
        r"weight 'blk\.0\.attn_q\.weight' holds a value of magnitude 1e\+07, beyond what q8_0 stores \(\|x\| <= "
        r"8\.31901e\+06: each block of 32 values shares a float16 scale", _scale_one_weight(1e7)),
    Row("gguf-f16-neg", (*GGUF, "--dtype", "float16"), r"magnitude 70000, beyond what float16", _scale_one_weight(-7e4)),
    Row("hf-f16-1e6", (*HF, "--dtype", "float16"),
        r"weight 'layers\.0\.attention\.wq\.weight' holds a value of magnitude 1e\+06, beyond what float16 stores "
        r"\(\|x\| <= 65504\)", _scale_one_weight(1e6)),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_refused_cleanly(row: Row, project, tmp_path, monkeypatch, capsys):
    table.test_bad_input_is_refused_cleanly(row, project, tmp_path, monkeypatch, capsys)


# -- export: what is written is finite ------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["q8_0", "bfloat16"])
def test_gguf_holds_1e6_in_q8_0_and_bfloat16_and_is_finite(project, tmp_path, dtype):
    gguf = pytest.importorskip("gguf")
    from lmforge.export import export_gguf

    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    _scale_one_weight(1e6)(work)
    out = export_gguf(work / "run", tmp_path / "m.gguf", dtype=dtype)
    tensors = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    for name, t in tensors.items():
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(values).all(), name
    q = gguf.quants.dequantize(tensors["blk.0.attn_q.weight"].data, tensors["blk.0.attn_q.weight"].tensor_type)
    assert abs(float(np.abs(q).max()) - 1e6) <= 1e6 * 2**-7  # the big weight survives (q8_0: one step of 1/127)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hf_export_is_finite(project, tmp_path, dtype):
    from safetensors.torch import load_file

    from lmforge.export import export_hf

    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    _scale_one_weight(6e4)(work)  # inside float16's range: written, and finite
    out = export_hf(work / "run", tmp_path / "hf", dtype=dtype)
    for name, t in load_file(str(out / "model.safetensors")).items():
        assert torch.isfinite(t).all(), name
        assert str(t.dtype) == f"torch.{dtype}"


# -- the check itself is exact at each limit ------------------------------------------------------
@pytest.mark.parametrize("dtype,ok,bad", [
    ("float16", 65519.0, 65520.0),  # 65519 rounds to 65504; 65520 rounds to infinity (round to nearest even)
    ("q8_0", 127 * 65519.0, 127 * 65520.0),  # the block scale |max| / 127 is a float16
    ("bfloat16", 3.3895e38, float(np.finfo(np.float32).max)),
])
def test_check_dtype_range_is_exact_at_the_limit(dtype, ok, bad):
    check_dtype_range("w", torch.tensor([[ok, -1.0]]), dtype)
    check_dtype_range("w", np.array([[-ok, 0.0]], dtype=np.float32), dtype)
    with pytest.raises(ExportError, match=rf"weight 'w' holds a value of magnitude .* beyond what {dtype} stores"):
        check_dtype_range("w", torch.tensor([[1.0, -bad]]), dtype)
    check_dtype_range("w", torch.tensor([bad]), "float32")  # float32 holds every finite float32
    # and the check agrees with the conversions the writers use
    target = torch.float16 if dtype != "bfloat16" else torch.bfloat16
    div = 127.0 if dtype == "q8_0" else 1.0
    assert math.isfinite(float((torch.tensor(ok) / div).to(target)))
    assert not math.isfinite(float((torch.tensor(bad) / div).to(target)))
