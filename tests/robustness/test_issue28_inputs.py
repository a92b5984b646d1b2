"""Bad-input classes of issue 28, each with several members, through the robustness table's runner
(exit 2, one `error:` line naming the field or file, no traceback, every file byte-identical):

- `--set` giving a list, a table or a multi-line value to a text or number field, and a
  config file's multi-line text;
- input nested hundreds of levels deep (a TOML recipe, a `--set` value, the JSON files lmforge
  reads: a Hugging Face config.json, tokenizer_config.json, a checkpoint's contract.json and
  training state);
- numbers that make no sense (a learning-rate scale of 0, a max_chars no function fits, a rope
  theta below 1, a llama3 rope factor below 1);
and what must work instead of being refused or read:
- paths whose bytes are not UTF-8 (a real Linux name): --out, sft.data, sft.init, a LoRA run's
  base, a corpus file's name (its text is trained on, not dropped);
- a link to a device and a FIFO inside a corpus folder: skipped, counted and named, never read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import test_bad_inputs as table
from test_bad_inputs import C, PRETRAIN, SFT_SETS, Row, project, setcfg, write  # noqa: F401

from lmforge.config import load_config
from lmforge.errors import ConfigError

ROWS: list[Row] = []


def add(id: str, argv, match: str, damage=None) -> None:
    ROWS.append(Row(id, tuple(argv), match, damage))


SFT = ("sft", *C, *SFT_SETS, "--out", "newsft", "--no-progress")

# -- --set: lists, tables, line breaks ------------------------------------------------------------
for id, value, match in [
    ("set-list-to-text", "data.source=[1,2]", r"data\.source is a text field, and '\[1,2\]' is a list"),
    ("set-table-to-text", "data.dir={a=1}", r"data\.dir is a text field, and '\{a=1\}' is a table"),
    ("set-list-to-init", 'train.init=["run"]', r"train\.init is a text field.*is a list"),
    ("set-multiline-text", "data.dir=da\nta", r"control character '\\n'"),
    ("set-multiline-number", "train.steps=\n3", r"control character '\\n'"),
    ("set-tab-text", "data.source=cor\tpus", r"control character '\\t'"),
    ("set-toml-multiline-string", 'data.dir="""x\ny"""', r"control character '\\n'"),
    ("set-escaped-newline", 'data.dir="x\\ny"', r"data\.dir = 'x\\ny' holds the control character"),
    ("set-list-to-number", "train.lr=[1e-3]", r"train\.lr = \[0\.001\] has type list, expected float"),
]:
    add(id, (*PRETRAIN[:-3], "--set", value, "--out", "newrun", "--no-progress"), match)
add("set-list-to-sft-data", (*SFT[:-3], "--set", "sft.data=[1]", "--out", "newsft"), r"sft\.data is a text field")
add("set-table-to-eos-token", ("import-hf", "hf", "--out", "newimp", "--set", "tokenizer.eos_token={x=1}"),
    r"tokenizer\.eos_token is a text field.*is a table")
add("cfg-multiline-path", PRETRAIN, r"cfg\.toml: data\.dir = 'da\\nta' holds the control character",
    setcfg('[data]\ndir = """da\nta"""\n'))

# -- nested too deeply ------------------------------------------------------------------------------
DEEP = 2000
add("cfg-deep-array", PRETRAIN, r"cfg\.toml: nested too deeply", setcfg("[train]\nsteps = " + "[" * DEEP + "]" * DEEP))
add("cfg-deep-table", PRETRAIN, r"cfg\.toml: nested too deeply",
    setcfg("[train]\nsteps = " + "{a = " * DEEP + "1" + "}" * DEEP))
add("set-deep", (*PRETRAIN[:-3], "--set", "train.steps=" + "[" * DEEP + "]" * DEEP, "--out", "newrun"),
    r"--set value .*nested too deeply")
DEEP_JSON = "[" * 100_000 + "]" * 100_000
add("hf-config-deep", ("import-hf", "hf", "--out", "newimp"), r"hf/config\.json.*nested too deeply",
    write("hf/config.json", DEEP_JSON))
add("hf-tokenizer-config-deep", ("import-hf", "hf", "--out", "newimp"), r"tokenizer_config\.json.*nested too deeply",
    write("hf/tokenizer_config.json", DEEP_JSON))
add("contract-deep", ("eval", "--checkpoint", "run"), r"contract\.json.*nested too deeply",
    write("run/step_000002/contract.json", DEEP_JSON))
add("state-deep", ("pretrain", *C, "--set", "train.steps=4", "--resume", "--out", "run", "--no-progress"),
    r"state\.json.*nested too deeply", write("run/step_000002/state.json", DEEP_JSON))
add("sft-record-deep", SFT, r"chat\.jsonl:1.*nested too deeply", write("chat.jsonl", DEEP_JSON + "\n"))

# -- numbers that make no sense -----------------------------------------------------------------------
for id, value, match in [
    ("muon-lr-scale-0", "train.muon_lr_scale=0", r"train\.muon_lr_scale = 0\.0: expected 0\.0 < value"),
    ("embed-lr-scale-0", "train.embed_lr_scale=0", r"train\.embed_lr_scale = 0\.0: expected 0\.0 < value"),
    ("head-lr-scale-0", "train.head_lr_scale=0", r"train\.head_lr_scale = 0\.0: expected 0\.0 < value"),
    ("rope-theta-half", "model.rope_theta=0.5", r"model\.rope_theta = 0\.5: expected 1\.0 < value"),
    ("rope-theta-1", "model.rope_theta=1", r"model\.rope_theta = 1\.0: expected 1\.0 < value"),
    ("rope-factor-half", "model.rope_factor=0.5", r"model\.rope_factor = 0\.5: expected 1\.0 <= value"),
]:
    add(id, (*PRETRAIN[:-3], "--set", value, "--out", "newrun", "--no-progress"), match)
add("sft-max-chars-5", (*SFT[:-3], "--set", "sft.max_chars=5", "--out", "newsft"),
    r"sft\.max_chars = 5: .*at least 100")
add("dpo-max-chars-99", ("dpo", *C, "--set", "dpo.init=sft", "--set", "dpo.max_chars=99", "--out", "newdpo"),
    r"dpo\.max_chars = 99: .*at least 100")


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_refused_cleanly(row: Row, project, tmp_path, monkeypatch, capsys):
    table.test_bad_input_is_refused_cleanly(row, project, tmp_path, monkeypatch, capsys)


def test_zero_max_chars_still_means_no_limit_and_100_is_accepted():
    for key in ("sft.max_chars", "dpo.max_chars"):
        for value in (0, 100, 900):
            load_config(None, [f"{key}={value}"])
        with pytest.raises(ConfigError):
            load_config(None, [f"{key}=1"])


# -- paths whose bytes are not UTF-8 -------------------------------------------------------------------
def _run(argv: list, cwd: Path, ok: bool = True) -> subprocess.CompletedProcess:
    """The console command with bytes arguments (as a shell passes a Linux file name), in a UTF-8
    locale whose stdout is strict (where a print of such a name used to crash)."""
    cmd = [sys.executable, "-m", "lmforge", *argv]
    env = dict(os.environ, LANG="en_US.UTF-8", LC_ALL="en_US.UTF-8", PYTHONUTF8="0")
    r = subprocess.run([os.fsencode(c) if isinstance(c, str) else c for c in cmd], cwd=cwd, capture_output=True,
                       env=env, timeout=300)
    if ok:
        assert r.returncode == 0, r.stderr.decode("utf-8", "replace")[-3000:]
        assert b"Traceback" not in r.stderr
    return r


@pytest.mark.slow
def test_paths_whose_bytes_are_not_utf8_work_through_sft_lora_resume_and_generate(project, tmp_path):
    """sft.data = chat\\xff.jsonl, sft.init = run\\xfd (a copy), --out sft\\xfe with LoRA, then
    --resume and generate; config.toml keeps the paths (read back equal), the LoRA metadata
    keeps the base; before the fix: UnicodeEncodeError writing config.toml, a half-made run."""
    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    wb = os.fsencode(work)
    shutil.copy(work / "chat.jsonl", os.fsdecode(os.path.join(wb, b"chat\xff.jsonl")))
    shutil.copytree(work / "run", os.fsdecode(os.path.join(wb, b"run\xfd")))
    sets = [b"--set", b"sft.data=chat\xff.jsonl", b"--set", b"sft.init=run\xfd", b"--set", b"lora.rank=2",
            b"--set", b"sft.val_examples=0", b"--set", b"data.val_fraction=0.25", b"--set", b"sft.micro_batch_size=2"]
    _run(["sft", *C, *sets, "--set", "sft.steps=1", "--out", b"sft\xfe", "--no-progress"], work)
    out = Path(os.fsdecode(os.path.join(wb, b"sft\xfe")))
    saved = load_config(out / "config.toml")
    assert saved.sft.data == os.fsdecode(b"chat\xff.jsonl") and saved.sft.init == os.fsdecode(b"run\xfd")
    _run(["sft", *C, *sets, "--set", "sft.steps=2", "--resume", "--out", b"sft\xfe", "--no-progress"], work)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    r = _run(["generate", *C, "--checkpoint", b"sft\xfe", "--prompt", "x", "--max-new-tokens", "3", "--greedy"], work)
    assert r.stdout.strip()


@pytest.mark.slow
def test_outputs_and_corpus_files_whose_names_are_not_utf8(project, tmp_path):
    """--out data\\xff for prepare and a corpus file caf\\xe9.txt: its text is a document (named
    with \\xe9 in report.json), not dropped as "not UTF-8"."""
    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    name = os.path.join(os.fsencode(work / "corpus"), b"caf\xe9.txt")
    with open(name, "w", encoding="utf-8") as f:
        f.write("def cafe():\n    return 'caf\u00e9'\n" * 50)
    _run(["prepare", *C, "--out", b"data\xff", "--no-progress"], work)
    out = Path(os.fsdecode(os.path.join(os.fsencode(work), b"data\xff")))
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    assert meta["skipped_bad_utf8"] == 0
    assert sum(s["documents"] for s in meta["splits"].values()) == 31  # 30 + the cafe file
    report = (out / "report.json").read_text(encoding="utf-8")
    assert "caf\\\\xe9.txt" in report  # in the largest documents: its name with the byte shown


# -- links to devices, FIFOs ---------------------------------------------------------------------------
def test_a_link_to_a_device_and_a_fifo_in_a_corpus_are_skipped_counted_and_never_read(project, tmp_path, capsys):
    from lmforge.cli import main

    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    (work / "corpus" / "zero.txt").symlink_to("/dev/zero")  # read, it would never end
    os.mkfifo(work / "corpus" / "pipe.py")  # read, it would block forever
    (work / "corpus" / "tty.md").symlink_to("/dev/null")
    here = os.getcwd()
    os.chdir(work)
    try:
        assert main(["train-tokenizer", *C, "--out", "newtok", "--no-progress"]) == 0
        assert main(["prepare", *C, "--out", "newdata", "--no-progress"]) == 0
    finally:
        os.chdir(here)
    err = capsys.readouterr().err
    assert "3 files that are not regular files skipped, never read" in err
    meta = json.loads((work / "newdata" / "meta.json").read_text())
    assert meta["skipped_not_regular"] == 3
    assert sorted(meta["skipped_names"]) == [f"corpus/{n}" for n in ("pipe.py", "tty.md", "zero.txt")]
    assert sum(s["documents"] for s in meta["splits"].values()) == 30
