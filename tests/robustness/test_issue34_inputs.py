"""Hardening, round four (issue 34): each class with several members, through the robustness
table's runner (exit 2, one `error:` line naming the field or file, no traceback, every file
byte-identical) or, where the input must work, a run that checks what it made:

- a dry run fails exactly where the run would: --out an existing run without --resume, a plain
  file, another command's run; --resume --dry-run loads the checkpoint and applies the resume rules;
- the Hugging Face cache: a snapshot's files are links into ../../blobs/ (imported), a link
  elsewhere is still refused;
- --resume compares every data input by content (sft.data, dpo.data, the pretraining data folder);
- derived settings are bounded like typed ones (train.time_budget_s -> train.steps, an automatic
  micro-batch of a huge global batch, the tokens of one optimizer step);
- errors that name what is wrong: the zero size field of a config.json, the damaged shard's file,
  the GGUF file (never lmforge's temporary folder), a GGUF head count of 0;
- values that make no sense: a fractional or non-numeric vocab_size, float8 weights, a LoRA rank
  larger than a layer's smaller side, an explicit --set model.X beside train.init that disagrees,
  `export --format peft` over a Hugging Face export folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import test_bad_inputs as table
from test_bad_inputs import C, PRETRAIN, SFT_SETS, Row, both, edit_json, project, write  # noqa: F401

from lmforge.cli import main

ROWS: list[Row] = []


def add(id: str, argv, match: str, damage=None) -> None:
    ROWS.append(Row(id, tuple(argv), match, damage))


def append(rel: str, text: str):
    def f(p: Path) -> None:
        with open(p / rel, "a", encoding="utf-8") as fh:
            fh.write(text)
    return f


SFT_RUN = ("sft", *C, *SFT_SETS, "--no-progress")
RESUME_PRE = ("pretrain", *C, "--resume", "--out", "run", "--no-progress")
RESUME_SFT = (*SFT_RUN[:-1], "--set", "sft.steps=2", "--resume", "--out", "sft", "--no-progress")

# -- a dry run fails where the run fails ---------------------------------------------------------------
DRY_CASES = [
    ("existing-run", (*PRETRAIN[:-3], "--out", "run"), r"already holds a `lmforge pretrain` run with checkpoints"),
    ("plain-file", (*PRETRAIN[:-3], "--out", "notes.txt"), r"--out notes\.txt is an existing file, not a folder"),
    ("other-command", (*PRETRAIN[:-3], "--out", "sft"), r"sft"),
    ("sft-over-pretrain-run", (*SFT_RUN, "--out", "run"), r"--out run"),
    ("resume-other-model", (*RESUME_PRE[:-4], "--set", "model.dim=64", "--resume", "--out", "run"),
     r"different \[model\] section|model\.dim"),
    ("resume-other-seq-len", (*RESUME_PRE[:-4], "--set", "data.seq_len=32", "--resume", "--out", "run"),
     r"data\.seq_len = 32"),
    ("resume-past-steps", ("pretrain", *C, "--set", "train.steps=1", "--resume", "--out", "run"), r"past train\.steps"),
    ("resume-damaged-state", RESUME_PRE[:-1], r"state\.json", write("run/step_000002/state.json", "{")),
]
for id, argv, match, *damage in DRY_CASES:
    add(f"dry-{id}", (*argv, "--dry-run"), match, damage[0] if damage else None)
    add(f"run-{id}", argv, match, damage[0] if damage else None)  # the real command, for the same words


def test_a_dry_run_fails_with_the_real_commands_words(project, tmp_path, monkeypatch, capsys):
    """Each dry-run row's error line equals the real command's (same input, fresh copies)."""
    lines = {}
    for row in [r for r in ROWS if r.id.startswith(("dry-", "run-"))]:
        work = tmp_path / row.id
        shutil.copytree(project, work, symlinks=True)
        monkeypatch.chdir(work)
        if row.damage:
            row.damage(work)
        capsys.readouterr()
        assert main(list(row.argv)) == 2, row.id
        err = capsys.readouterr().err
        lines[row.id] = err[err.index("error:"):].strip()
    for id, *_ in DRY_CASES:
        assert lines[f"dry-{id}"] == lines[f"run-{id}"], id


def test_resume_dry_run_loads_the_checkpoint_and_writes_nothing(project, tmp_path, monkeypatch, capsys):
    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    monkeypatch.chdir(work)
    before = table.tree_hash(work)
    assert main([*RESUME_PRE, "--dry-run"]) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*PRETRAIN[:-3], "--dry-run", "--out", "fresh"]) == 0
    fresh = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert table.tree_hash(work) == before  # nothing written, metrics.jsonl not cut
    # the trained weights score the first batch better than fresh ones: the checkpoint was loaded
    assert resumed["loss"] < fresh["loss"] - 0.05, (resumed["loss"], fresh["loss"])


# -- the Hugging Face cache ------------------------------------------------------------------------------
def hub_cache(src: Path, cache: Path, org_name: str = "models--org--tiny", rev: str = "0123abcd") -> Path:
    """`src`'s files laid out as huggingface_hub's cache: blobs named by their sha256 and a
    snapshot folder of relative links into ../../blobs/."""
    model = cache / org_name
    (model / "blobs").mkdir(parents=True)
    snap = model / "snapshots" / rev
    snap.mkdir(parents=True)
    (model / "refs").mkdir()
    (model / "refs" / "main").write_text(rev)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = model / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    return snap


def test_a_hub_cache_snapshot_imports_and_links_elsewhere_are_refused(project, tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    from lmforge.model import load_model

    snap = hub_cache(project / "hf", tmp_path / "hub")
    assert all((snap / n).is_symlink() for n in ("config.json", "model.safetensors", "tokenizer.json"))
    assert main(["import-hf", str(snap), "--out", str(tmp_path / "imp")]) == 0
    ours = load_model(tmp_path / "imp")[0]
    ref = load_model(project / "run")[0]
    tokens = torch.tensor([[1, 5, 9, 17, 33]])
    with torch.no_grad():
        assert float((ours(tokens) - ref(tokens)).abs().max()) < 1e-5
    # a link out of the model's cache folder (another model's blob, a file elsewhere) is refused
    other = hub_cache(project / "hf", tmp_path / "hub", "models--org--other", "ffff")
    for target in (Path("..") / ".." / ".." / "models--org--other" / "blobs" /
                   os.readlink(other / "config.json").split("/")[-1], project / "hf" / "config.json"):
        (snap / "config.json").unlink()
        (snap / "config.json").symlink_to(target)
        capsys.readouterr()
        before = table.tree_hash(tmp_path / "hub")
        assert main(["import-hf", str(snap), "--out", str(tmp_path / "imp2")]) == 2
        err = capsys.readouterr().err
        assert "leads outside the model's cache folder" in err and "Traceback" not in err, err
        assert table.tree_hash(tmp_path / "hub") == before and not (tmp_path / "imp2").exists()


# -- resume compares data by content -------------------------------------------------------------------
NEW_CHAT = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n"
add("resume-sft-data-edited", RESUME_SFT, r"sft\.data = 'chat\.jsonl' changed since the run started",
    append("chat.jsonl", NEW_CHAT))
add("resume-sft-data-edited-same-size", RESUME_SFT, r"chat\.jsonl.*sha256",
    lambda p: (p / "chat.jsonl").write_bytes((p / "chat.jsonl").read_bytes().replace(b"value", b"VALUE", 1)))
add("resume-pretrain-data-reprepared", RESUME_PRE, r"data\.dir = 'data' changed since the run started",
    both(append("corpus/doc_000.py", "print('one more line')\n"),
         lambda p: main(["prepare", *C, "--out", "data", "--no-progress"])))


# -- derived settings ----------------------------------------------------------------------------------
add("time-budget-past-steps-bound", (*PRETRAIN[:-3], "--set", "train.time_budget_s=1e8", "--out", "newrun"),
    r"train\.steps = [0-9]+: .*derived from train\.time_budget_s = 1e\+08.*Lower train\.time_budget_s")
add("auto-batch-huge-global", (*PRETRAIN[:-3], "--set", "train.micro_batch_size=auto", "--set",
                               "train.global_batch_size=1000000000", "--out", "newrun"),
    r"tokens per optimizer step")
add("auto-batch-huge-global-dry", (*PRETRAIN[:-3], "--set", "train.micro_batch_size=auto", "--set",
                                   "train.global_batch_size=1000000000", "--dry-run"), r"tokens per optimizer step")
add("typed-huge-step", (*PRETRAIN[:-3], "--set", "train.micro_batch_size=1048576", "--set",
                        "train.grad_accum_steps=65536", "--out", "newrun"), r"tokens per optimizer step")


# -- errors that name what is wrong ----------------------------------------------------------------------
for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "num_key_value_heads",
            "max_position_embeddings"):
    add(f"hf-{key}-0", ("import-hf", "hf", "--out", "newimp"), rf"{key} = 0", edit_json("hf/config.json",
                                                                                     lambda c, k=key: c.update({k: 0})))
add("hf-damaged-shard", ("import-hf", "hf", "--out", "newimp"), r"hf/model-00002-of-00002\.safetensors",
    lambda p: _shard(p, damage=True))


def _shard(p: Path, damage: bool) -> None:
    """hf/model.safetensors split into two shards with an index; the second damaged."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(p / "hf" / "model.safetensors"))
    names = sorted(state)
    half = {n: state[n] for n in names[: len(names) // 2]}, {n: state[n] for n in names[len(names) // 2:]}
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for f, part in zip(files, half):
        save_file(part, str(p / "hf" / f), metadata={"format": "pt"})
    (p / "hf" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: files[0] if n in half[0] else files[1] for n in names}}))
    (p / "hf" / "model.safetensors").unlink()
    if damage:
        data = (p / "hf" / files[1]).read_bytes()
        (p / "hf" / files[1]).write_bytes(data[: len(data) // 2])


# -- values that make no sense ------------------------------------------------------------------------
for id, value, match in [("fractional", 420.5, r"vocab_size = 420\.5: expected an integer"),
                         ("string", "420", r"vocab_size = '420': expected an integer"),
                         ("list", [420], r"vocab_size = \[420\]: expected an integer"),
                         ("zero", 0, r"vocab_size = 0")]:
    add(f"hf-vocab-{id}", ("import-hf", "hf", "--out", "newimp"), match,
        edit_json("hf/config.json", lambda c, v=value: c.update(vocab_size=v)))


def _fp8(p: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(p / "hf" / "model.safetensors"))
    name = sorted(state)[0]
    state[name] = state[name].to(torch.float8_e4m3fn)
    save_file(state, str(p / "hf" / "model.safetensors"), metadata={"format": "pt"})


add("hf-fp8-weights", ("import-hf", "hf", "--out", "newimp"), r"float8_e4m3fn.*float32, bfloat16 and float16", _fp8)
add("lora-rank-past-layer", (*SFT_RUN, "--set", "lora.rank=33", "--out", "newsft"),
    r"lora\.rank = 33 .*wq.*32")
add("lora-rank-past-kv", (*SFT_RUN, "--set", "lora.rank=17", "--set", "lora.targets=['wk']", "--out", "newsft"),
    r"lora\.rank = 17 .*wk.*16")
add("init-explicit-model-dim", ("pretrain", *C, "--set", "train.init=run", "--set", "model.dim=64", "--out", "newrun"),
    r"model\.dim = 64 .*train\.init.*32")
add("sft-init-explicit-layers", (*SFT_RUN, "--set", "model.n_layers=3", "--out", "newsft"),
    r"model\.n_layers = 3 .*sft\.init.*2")
add("peft-over-hf-export", ("export", "--checkpoint", "sft", "--format", "peft", "--out", "hf"),
    r"--out hf is a Hugging Face export folder \(lmforge export --format hf\)")


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_refused_cleanly(row: Row, project, tmp_path, monkeypatch, capsys):
    table.test_bad_input_is_refused_cleanly(row, project, tmp_path, monkeypatch, capsys)


def test_a_run_whose_data_is_unchanged_resumes(project, tmp_path, monkeypatch, capsys):
    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    monkeypatch.chdir(work)
    assert main(list(RESUME_SFT)) == 0
    assert main(list(RESUME_PRE)) == 0


def test_sharded_weights_import(project, tmp_path, monkeypatch):
    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    _shard(work, damage=False)
    monkeypatch.chdir(work)
    assert main(["import-hf", "hf", "--out", "imp"]) == 0


def test_a_gguf_with_zero_heads_or_a_bad_config_names_the_file(project, tmp_path, capsys):
    """A GGUF whose head count is 0 (a ZeroDivisionError before), and one whose converted config
    lmforge refuses: the error names the .gguf file, never the temporary folder."""
    gguf = pytest.importorskip("gguf")
    from lmforge.export import export_gguf

    src = tmp_path / "m.gguf"
    export_gguf(project / "run", src)
    arch = gguf.GGUFReader(str(src)).fields["general.architecture"].contents()
    for key, value, said in ((f"{arch}.attention.head_count", 0, f"{arch}.attention.head_count = 0"),
                             (f"{arch}.block_count", 0, f"{arch}.block_count = 0"),
                             (f"{arch}.embedding_length", -3, f"{arch}.embedding_length = -3"),
                             # refused under the file's own key, lmforge's field beside it
                             (f"{arch}.attention.layer_norm_rms_epsilon", 0.0,
                              f"{arch}.attention.layer_norm_rms_epsilon = 0.0: expected 0 < value <= 1 (lmforge's "
                              f"model.norm_eps)")):
        bad = tmp_path / f"bad-{key.split('.')[-1]}.gguf"
        _rewrite_gguf(gguf, src, bad, {key: value})
        capsys.readouterr()
        assert main(["import-gguf", str(bad), "--out", str(tmp_path / "imp")]) == 2, key
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.count("error:") == 1, err
        assert str(bad) in err and "lmforge-gguf-" not in err and said in err, err
        assert not (tmp_path / "imp").exists()


def _rewrite_gguf(gguf, src: Path, dst: Path, changes: dict) -> None:
    """A copy of `src` with the integer fields of `changes` set (same tensors)."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = changes.get(name, f.contents())
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, vtype, sub_type=f.types[-1])
        elif name in changes:
            kind = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.INT32
            writer.add_key_value(name, value, kind)
        else:
            writer.add_key_value(name, value, vtype)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=list(reversed([int(d) for d in t.shape])), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_error_names_every_size_that_is_not_positive(project, tmp_path, monkeypatch, capsys):
    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    edit_json("hf/config.json", lambda c: c.update(hidden_size=0, num_hidden_layers=-1))(work)
    monkeypatch.chdir(work)
    assert main(["import-hf", "hf", "--out", "newimp"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"hidden_size = 0.*num_hidden_layers = -1", err), err
    assert "..." not in err
