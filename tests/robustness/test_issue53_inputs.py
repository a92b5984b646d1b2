"""Hardening, round six (issue 53): each class with its members, through the robustness table's
runner (exit 2, one `error:` line naming the file or field, the value and what to do, no
traceback, every file byte-identical) or, where the input must work, a run that checks what it
made:

- the overlay is an input, never a record: a checkpoint's config.toml is read as saved, so an
  `LMFORGE_CONFIG_OVERLAY` that changes what `--set` may not change on `--resume` (a [model]
  field, a learning rate step 1 already took) is refused naming the overlay and the field, as
  a run from a checkpoint refuses its [model]; generate, eval, export (and serve, chat, through
  the same loader) take the checkpoint's [model] as saved and say in one line that the
  overlay's is ignored (as `--set model.X` is there), and a bad overlay is blamed, not the
  checkpoint; a resume past a fine-tuning run's step count names that stage's key;
- every compressed reader is all-or-nothing: a damaged later stream of a multi-stream
  `.jsonl.bz2` / `.jsonl.xz`, or bytes after its last stream, stop prepare, train-tokenizer and
  a fine-tuning run naming the file and the last good line; a valid multi-stream file (and xz's
  stream padding) is read completely;
- no output replaces one of the command's inputs: `--out` is never the `--config` file, the
  overlay file, or one of `--checkpoint`'s files, with or without `--force`, for every command
  that writes a file or a folder.
"""

from __future__ import annotations

import bz2
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

import test_bad_inputs as table
from test_bad_inputs import C, PREPARE, SFT_SETS, TOKENIZE, project, write  # noqa: F401

from lmforge.cli import main

OVERLAY = "LMFORGE_CONFIG_OVERLAY"
KEEP = ""  # an overlay that is a file of the project, as it is


class Row:
    """A bad input: argv, the words of its one error line, the damage, and the overlay's text
    (written to overlay.toml and named by LMFORGE_CONFIG_OVERLAY) or None."""

    def __init__(self, id: str, argv, match: str, damage=None, overlay: str | None = None,
                 overlay_at: str = "overlay.toml"):
        self.id, self.argv, self.match, self.damage = id, tuple(argv), match, damage
        self.overlay, self.overlay_at = overlay, overlay_at


ROWS: list[Row] = []


def add(id: str, argv, match: str, damage=None, overlay: str | None = None, overlay_at: str = "overlay.toml") -> None:
    ROWS.append(Row(id, argv, match, damage, overlay, overlay_at))


def both(*fs):
    def f(p: Path) -> None:
        for g in fs:
            g(p)
    return f


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _work(project: Path, tmp_path: Path, monkeypatch, overlay: str | None = None,
          overlay_at: str = "overlay.toml") -> Path:
    """A fresh copy of the project as the current folder; `overlay`: the text of the overlay file
    `overlay_at` (KEEP: the project's file as it is), named by LMFORGE_CONFIG_OVERLAY (else the
    variable is unset)."""
    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    if overlay is not None:
        if overlay != KEEP:
            (work / overlay_at).write_text(overlay, encoding="utf-8")
        monkeypatch.setenv(OVERLAY, overlay_at)
    else:
        monkeypatch.delenv(OVERLAY, raising=False)
    return work


# -- 1. the overlay is an input, never a record -----------------------------------------------------
RESUME = ("pretrain", *C, "--resume", "--out", "run", "--no-progress")
SOFTCAP = "[model]\nfinal_softcap = 0.5\n"
add("resume-overlay-model-field", RESUME,
    r"run/step_000002/config\.toml: model\.final_softcap = 0\.5, set by LMFORGE_CONFIG_OVERLAY=overlay\.toml "
    r"\(the run has 0\.0\): a different \[model\] section is another architecture.*remove them from "
    r"LMFORGE_CONFIG_OVERLAY=overlay\.toml, or unset it", overlay=SOFTCAP)
add("resume-overlay-model-field-dry-run", (*RESUME[:-1], "--dry-run"),
    r"model\.final_softcap = 0\.5, set by LMFORGE_CONFIG_OVERLAY=overlay\.toml", overlay=SOFTCAP)
add("resume-overlay-lr", RESUME,
    r"train\.lr = 0\.5, set by LMFORGE_CONFIG_OVERLAY=overlay\.toml \(the run has 0\.01\): step 1 of the run "
    r"already took learning rate .*remove them from LMFORGE_CONFIG_OVERLAY=overlay\.toml", overlay="[train]\nlr = 0.5\n")
add("resume-overlay-seed", RESUME,
    r"train\.seed = 7, set by LMFORGE_CONFIG_OVERLAY=overlay\.toml \(the run has 1337\)", overlay="[train]\nseed = 7\n")
SFT_RESUME = ("sft", *C, *SFT_SETS, "--resume", "--out", "sft", "--no-progress")
add("sft-resume-overlay-lr", SFT_RESUME,
    r"sft\.lr = 0\.5, set by LMFORGE_CONFIG_OVERLAY=overlay\.toml \(the run has", overlay="[sft]\nlr = 0.5\n")
add("sft-resume-overlay-model-field", SFT_RESUME,
    r"model\.attn_softcap = 0\.001 \(LMFORGE_CONFIG_OVERLAY=overlay\.toml\), but sft\.init = 'run' has "
    r"model\.attn_softcap = 0\.0.*Remove model\.attn_softcap from LMFORGE_CONFIG_OVERLAY=overlay\.toml",
    overlay="[model]\nattn_softcap = 0.001\n")
add("sft-init-overlay-model-field", ("sft", *C, *SFT_SETS, "--out", "newsft", "--no-progress"),
    r"model\.dim = 64 \(LMFORGE_CONFIG_OVERLAY=overlay\.toml\), but sft\.init = 'run' has model\.dim = 32: a run "
    r"from a checkpoint keeps its \[model\] section", overlay="[model]\ndim = 64\n")
add("export-bad-overlay-names-it", ("export", "--checkpoint", "run", "--out", "newhf"),
    r"LMFORGE_CONFIG_OVERLAY=overlay\.toml: model\.dim = 'big' has type str", overlay="[model]\ndim = 'big'\n")
add("eval-bad-overlay-names-it", ("eval", "--checkpoint", "run"),
    r"LMFORGE_CONFIG_OVERLAY=overlay\.toml: unknown key model\.softcap", overlay="[model]\nsoftcap = 1.0\n")


def test_a_resume_with_an_overlay_that_changes_only_what_may_change_runs(project, tmp_path, monkeypatch, capsys):
    """An overlay restating the run's [model] and changing only what a resume allows (how many
    checkpoints are kept, how often the bar prints) continues the run; the saved config.toml,
    read as saved, is left as it was."""
    work = _work(project, tmp_path, monkeypatch, "[model]\ndim = 32\n[train]\nkeep_last = 3\nlog_every = 2\n")
    saved = work / "run" / "step_000002" / "config.toml"
    before = _sha(saved)
    assert main(list(RESUME)) == 0, capsys.readouterr().err[-2000:]
    assert _sha(saved) == before


SOFTCAP_READ = "[model]\nattn_softcap = 0.001\n"
NOTE = (r"note: LMFORGE_CONFIG_OVERLAY=overlay\.toml sets model\.attn_softcap = 0\.001, but \S*run/step_000002 keeps its "
        r"own \[model\] \(model\.attn_softcap = 0\.0\): a checkpoint's model is read as saved, so the overlay's "
        r"\[model\] is ignored here \(as --set model\.X is\)")


def _outputs(project, tmp_path, monkeypatch, capsys, overlay: str | None, name: str) -> tuple[str, str, dict]:
    """generate's text, eval's figures and export's files of the project's run, under `overlay`."""
    work = tmp_path / name
    work.mkdir()
    _work(project, work, monkeypatch, overlay)
    capsys.readouterr()
    assert main(["generate", *C, "--checkpoint", "run", "--prompt", "def", "--max-new-tokens", "6", "--greedy"]) == 0
    gen = capsys.readouterr()
    assert main(["eval", "--checkpoint", "run", "--out", "e.json"]) == 0
    ev = capsys.readouterr()
    figures = json.loads((work / "p" / "e.json").read_text())
    assert main(["export", "--checkpoint", "run", "--out", "newhf"]) == 0
    ex = capsys.readouterr()
    files = {p.name: _sha(p) for p in sorted((work / "p" / "newhf").iterdir()) if p.name != "README.md"}
    return gen.out, gen.err + ev.err + ex.err, {"eval": [figures["loss"], figures["tokens"]], "export": files}


def test_generate_eval_export_read_a_checkpoints_model_as_saved(project, tmp_path, monkeypatch, capsys):
    """An overlay's attn_softcap = 0.001 (an imported Gemma 2 given another soft-cap emits garbage)
    changes nothing generate, eval or export make from a checkpoint, and each says in one line
    that the overlay's [model] is ignored there, as --set model.X is."""
    plain_text, plain_err, plain = _outputs(project, tmp_path, monkeypatch, capsys, None, "plain")
    text, err, overlaid = _outputs(project, tmp_path, monkeypatch, capsys, SOFTCAP_READ, "overlay")
    assert text == plain_text and overlaid == plain
    assert "note: LMFORGE_CONFIG_OVERLAY" not in plain_err
    assert re.search(NOTE, err), err[-2000:]
    assert "error:" not in err


def test_the_loader_of_serve_and_chat_reads_the_model_as_saved(project, tmp_path, monkeypatch, capsys):
    """serve and chat load through `load_checkpoint`: the checkpoint's own soft-cap, the note once."""
    from lmforge.loading import load_checkpoint

    _work(project, tmp_path, monkeypatch, SOFTCAP_READ)
    capsys.readouterr()
    first = load_checkpoint("run")
    second = load_checkpoint("run")
    err = capsys.readouterr().err
    assert first.config.model.attn_softcap == second.config.model.attn_softcap == 0.0
    assert first.model.config.attn_softcap == 0.0
    assert len(re.findall(NOTE, err)) == 1, err


def test_a_fine_tuning_resume_past_its_steps_names_its_own_key(project, tmp_path, monkeypatch, capsys):
    """The SFT run is at step 1 of sft.steps = 1; a resume with sft.steps lowered is impossible
    (at least 1), so the check is called as the trainer calls it, with the stage's key."""
    from lmforge.errors import CheckpointError
    from lmforge.train.resume import check_training_state

    work = _work(project, tmp_path, monkeypatch)
    latest = work / "sft" / "step_000001"
    with pytest.raises(CheckpointError, match=r"step_000001 is at step 1, past sft\.steps = 0\. Raise sft\.steps"):
        check_training_state({"step": 1}, latest, 0, work / "sft" / "metrics.jsonl", "sft.steps")
    src = Path(__file__).resolve().parents[2] / "src" / "lmforge" / "train" / "trainer.py"
    assert 'f"{stage}.steps"' in src.read_text()  # the trainer passes the stage's own key


# -- 2. every compressed reader is all-or-nothing ---------------------------------------------------
def _body(n: int, tag: str) -> bytes:
    return "".join(json.dumps({"text": f"def {tag}_{i}(value):\n    return value * {i} + {i % 7}\n"}) + "\n"
                   for i in range(n)).encode()


STREAMS = {".jsonl.bz2": bz2.compress, ".jsonl.xz": lzma.compress}


def two_streams(rel: str, kind: str, how: str):
    """Two streams of 200 records each back to back (as pbzip2, `xz -T0` or `cat a b` write), the
    second damaged as `how` says: "ok", "cut" (cut short), "damaged" (bytes of its header
    overwritten), "garbage" (bytes after it), "padding" (xz: 8 NUL bytes between and after)."""
    def f(p: Path) -> None:
        first, second = STREAMS[kind](_body(200, "first")), STREAMS[kind](_body(200, "second"))
        if how == "cut":
            second = second[: len(second) // 2]
        elif how == "damaged":
            second = second[:6] + b"\xff" * 24 + second[30:]
        elif how == "garbage":
            second = second + b"trailing bytes that are no stream\n"
        elif how == "padding":
            first, second = first + b"\0" * 8, second + b"\0" * 4
        (p / rel).parent.mkdir(parents=True, exist_ok=True)
        (p / rel).write_bytes(first + second)
    return f


DAMAGED = r"damaged or cut short after line {n}"
ANY_LINE = r"\d+"
for kind in STREAMS:
    tag = kind.replace(".", "-")
    name = re.escape(f"two{kind}")
    add(f"later-stream-damaged{tag}", PREPARE,
        rf"corpus/{name}: {DAMAGED.format(n=200)} \(the bytes after .* stream 1 are not another .* stream.*"
        r"re-write the file", two_streams(f"corpus/two{kind}", kind, "damaged"))
    add(f"later-stream-cut{tag}", PREPARE, rf"corpus/{name}: {DAMAGED.format(n=ANY_LINE)} \(the file ends inside "
        rf".* stream 2: it was cut short\)", two_streams(f"corpus/two{kind}", kind, "cut"))
    add(f"trailing-garbage{tag}", PREPARE,
        rf"corpus/{name}: {DAMAGED.format(n=400)} \(the bytes after .* stream 2 are not another",
        two_streams(f"corpus/two{kind}", kind, "garbage"))
    add(f"later-stream-damaged-alone{tag}", (*PREPARE[:-3], "--set", f"data.source=two{kind}", "--out", "newdata",
                                             "--no-progress"),
        rf"two{re.escape(kind)}: {DAMAGED.format(n=200)}", two_streams(f"two{kind}", kind, "damaged"))
    add(f"later-stream-damaged-tokenizer{tag}", TOKENIZE, rf"corpus/{name}: {DAMAGED.format(n=200)}",
        two_streams(f"corpus/two{kind}", kind, "damaged"))


def _chat_streams(kind: str):
    def f(p: Path) -> None:
        chat = (p / "chat.jsonl").read_bytes()
        second = STREAMS[kind](chat)
        (p / f"chat{kind}").write_bytes(STREAMS[kind](chat) + second[:6] + b"\xff" * 24 + second[30:])
    return f


for kind in STREAMS:
    add(f"sft-data-later-stream-damaged{kind.replace('.', '-')}",
        ("sft", *C, *SFT_SETS, "--set", f"sft.data=chat{kind}", "--out", "newsft", "--no-progress"),
        rf"chat{re.escape(kind)}: {DAMAGED.format(n=24)}", _chat_streams(kind))
add("xz-padding-not-a-multiple-of-four", PREPARE, r"corpus/two\.jsonl\.xz: damaged or cut short after line 200 "
    r"\(3 NUL bytes after stream 1: xz's stream padding is a multiple of four\)",
    write("corpus/two.jsonl.xz", lzma.compress(_body(200, "first")) + b"\0\0\0"))


@pytest.mark.parametrize("kind,how", [(k, h) for k in STREAMS for h in ("ok", "padding")
                                      if h == "ok" or k == ".jsonl.xz"])
def test_every_stream_of_a_multi_stream_file_is_read(kind, how, project, tmp_path, monkeypatch):
    """pbzip2, `xz -T0` and `cat a b` write several streams (xz: with stream padding): all 400
    documents of both streams are prepared."""
    work = _work(project, tmp_path, monkeypatch)
    two_streams(f"two{kind}", kind, how)(work)
    assert main([*PREPARE[:-3], "--set", f"data.source=two{kind}", "--set", "data.val_fraction=0.1",
                 "--out", "newdata", "--no-progress"]) == 0
    meta = json.loads((work / "newdata" / "meta.json").read_text())
    assert sum(s["documents"] for s in meta["splits"].values()) == 400


def test_the_reader_gives_every_line_before_the_damage(tmp_path):
    """The documents of the good first stream are read (and counted in the message) before the
    damaged second one stops the file: the last good line is the first stream's last."""
    from lmforge.data.records import iter_records
    from lmforge.errors import DataError

    for kind in STREAMS:
        two_streams(f"two{kind}", kind, "damaged")(tmp_path)
        seen = []
        with pytest.raises(DataError, match=rf"two{re.escape(kind)}: damaged or cut short after line 200 "):
            for where, _ in iter_records(tmp_path / f"two{kind}"):
                seen.append(where)
        assert len(seen) == 200 and seen[-1].endswith(":200")


# -- 3. no output replaces one of the command's inputs ---------------------------------------------
def _hardlink_cfg(p: Path) -> None:
    os.link(p / "cfg.toml", p / "cfg-link.toml")


def _imported(p: Path) -> None:
    """imp/: an earlier import-hf of hf/ (its config.toml is then given as --config)."""
    from lmforge.stages import import_hf_stage

    import_hf_stage(p / "hf", p / "imp")


def _ckpt_copy(p: Path) -> None:
    """mine/ckpt/: a copy of a checkpoint as a user makes it (cp -r: no lmforge marker)."""
    shutil.copytree(p / "run" / "step_000002", p / "mine" / "ckpt")
    for marker in (p / "mine" / "ckpt").glob(".lmforge-output"):
        marker.unlink()


TASKS = "".join(json.dumps({"query": f"def f{i}(x): return", "choices": [" x", " None"], "gold": 0}) + "\n"
                for i in range(3))
LOG_EVERY = "[train]\nlog_every = 1\n"
for force in ((), ("--force",)):
    sfx = "-force" if force else ""
    add(f"eval-out-is-config{sfx}", ("eval", *C, "--checkpoint", "run", "--out", "cfg.toml", *force),
        r"--out cfg\.toml is --config cfg\.toml, an input of this command: writing it would destroy that input, "
        r"--force or not\. Choose another --out")
    add(f"eval-tasks-out-is-config{sfx}", ("eval", *C, "--checkpoint", "run", "--tasks", "t.jsonl", "--out",
                                           "cfg.toml", *force),
        r"--out cfg\.toml is --config cfg\.toml, an input", write("t.jsonl", TASKS))
    add(f"export-gguf-out-is-config{sfx}", ("export", *C, "--checkpoint", "run", "--format", "gguf", "--out",
                                            "cfg.toml", *force), r"--out cfg\.toml is --config cfg\.toml, an input")
    add(f"eval-out-hardlink-to-config{sfx}", ("eval", *C, "--checkpoint", "run", "--out", "cfg-link.toml", *force),
        r"--out cfg-link\.toml is --config cfg\.toml \(the same file under another name: a hard link\)",
        _hardlink_cfg)
    add(f"eval-out-is-overlay{sfx}", ("eval", *C, "--checkpoint", "run", "--out", "overlay.toml", *force),
        r"--out overlay\.toml is LMFORGE_CONFIG_OVERLAY = 'overlay\.toml', an input of this command", overlay=LOG_EVERY)
    add(f"eval-tasks-out-is-overlay{sfx}", ("eval", "--checkpoint", "run", "--tasks", "t.jsonl", "--out",
                                            "overlay.toml", *force),
        r"--out overlay\.toml is LMFORGE_CONFIG_OVERLAY = 'overlay\.toml', an input", write("t.jsonl", TASKS),
        overlay=LOG_EVERY)
    add(f"export-gguf-out-is-overlay{sfx}", ("export", "--checkpoint", "run", "--format", "gguf", "--out",
                                             "overlay.toml", *force),
        r"--out overlay\.toml is LMFORGE_CONFIG_OVERLAY = 'overlay\.toml', an input", overlay=LOG_EVERY)
    for rel in ("run/step_000002/config.toml", "run/step_000002/model.safetensors", "run/step_000002/contract.json"):
        add(f"eval-out-is-checkpoint-file-{Path(rel).name}{sfx}", ("eval", "--checkpoint", "run", "--out", rel, *force),
            rf"{re.escape(rel)} .*(--checkpoint|inside)")
    add(f"eval-tasks-out-is-checkpoint-file{sfx}", ("eval", "--checkpoint", "run/step_000002", "--tasks", "t.jsonl",
                                                   "--out", "run/step_000002/tokenizer.json", *force),
        r"run/step_000002/tokenizer\.json .*(--checkpoint|inside)", write("t.jsonl", TASKS))
    add(f"export-gguf-out-is-checkpoint-file{sfx}", ("export", "--checkpoint", "run", "--format", "gguf", "--out",
                                                    "run/step_000002/model.safetensors", *force),
        r"run/step_000002/model\.safetensors .*(--checkpoint|inside)")
    add(f"eval-out-in-a-users-checkpoint-copy{sfx}", ("eval", "--checkpoint", "mine/ckpt", "--out",
                                                    "mine/ckpt/config.toml", *force),
        r"--out mine/ckpt/config\.toml is inside --checkpoint mine/ckpt, a folder this command reads", _ckpt_copy)
    add(f"export-gguf-out-in-a-users-checkpoint-copy{sfx}", ("export", "--checkpoint", "mine/ckpt", "--format", "gguf",
                                                            "--out", "mine/ckpt/model.safetensors", *force),
        r"--out mine/ckpt/model\.safetensors is inside --checkpoint mine/ckpt", _ckpt_copy)
add("prepare-out-holds-config", ("prepare", "--config", "data/config.toml", "--out", "data", "--no-progress"),
    r"--out data holds --config data/config\.toml, an input of this command")
add("train-tokenizer-out-holds-config", ("train-tokenizer", "--config", "tok/config.toml", "--out", "tok",
                                         "--no-progress"), r"--out tok holds --config tok/config\.toml, an input")
add("prepare-default-out-holds-overlay", ("prepare", *C, "--no-progress"),  # data.dir = data: the default --out
    r"--out data holds LMFORGE_CONFIG_OVERLAY = 'data/config\.toml', an input", overlay=KEEP,
    overlay_at="data/config.toml")
add("import-hf-out-holds-config", ("import-hf", "hf", "--config", "imp/config.toml", "--out", "imp"),
    r"--out imp holds --config imp/config\.toml, an input", _imported)


def _run_row(row: Row, project, tmp_path, monkeypatch, capsys) -> None:
    work = _work(project, tmp_path, monkeypatch, row.overlay, row.overlay_at)
    if row.damage is not None:
        row.damage(work)
    before = table.tree_hash(tmp_path)
    capsys.readouterr()
    rc = main(list(row.argv))
    out, err = capsys.readouterr()
    assert rc == 2, f"exit {rc}\n{err[-3000:]}"
    assert err.count("error:") == 1 and "Traceback" not in err, err[-3000:]
    line = err[err.index("error:"):]
    assert re.search(row.match, line, re.S), f"{row.match!r} not in {line!r}"
    assert table.tree_hash(tmp_path) == before, "files changed, appeared or vanished"


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_refused_cleanly(row: Row, project, tmp_path, monkeypatch, capsys):
    _run_row(row, project, tmp_path, monkeypatch, capsys)


def test_the_rows_are_many_and_unique():
    assert len({r.id for r in ROWS}) == len(ROWS) >= 45


def test_the_readme_overlay_holds_no_key_a_command_would_now_refuse():
    """tests/readme_smoke.toml's keys: what `--resume` refuses is the same as the run it resumes
    (every run of the README is made with the overlay), and its [model] equals the fixtures'
    imported models (tests/readme_runner.py), so a run from them is not refused."""
    import tomllib

    smoke = tomllib.loads((Path(__file__).resolve().parents[1] / "readme_smoke.toml").read_text())
    assert set(smoke["model"]) == {"dim", "n_layers", "n_heads", "n_kv_heads"}
    assert (smoke["model"]["dim"], smoke["model"]["n_layers"], smoke["model"]["n_heads"],
            smoke["model"]["n_kv_heads"]) == (64, 2, 4, 2)  # tests/hf_families.py's tiny models
