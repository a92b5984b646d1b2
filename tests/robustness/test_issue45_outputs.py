"""Hardening, round five (issue 45), the rest of the list: each class with its members, through
the robustness table's runner (exit 2, one `error:` line naming the key or flag, the value and
what to do, no traceback, every file byte-identical) or, where the input must work, a run that
checks what it printed:

- no output is one of its inputs, for the commands `test_issue45_inputs.py` left: train-tokenizer
  (--out inside data.source's folder, a glob's base folder, a mixture source's folder),
  import-tokenizer (--out inside the --from folder, or inside the corpus its report samples),
  the training stages (pretrain, sft, dpo, rl: sft.data, dpo.data, rl.data, train.eval_tasks, tokenizer.dir, data.dir
  inside the run folder or the run folder inside them), the speedrun (its folder inside the corpus,
  the corpus inside its folder); a run folder beside its data, and `--resume` of a run, still work;
- a conversation record of two forms (OpenAI `messages`, ShareGPT `conversations`, Alpaca
  `instruction`/`output`) is refused naming the file, the line and the keys of each form (a
  preference record of both of its forms already was: held by a row);
- a disk that fills up under TensorBoard's writer thread: one clean error naming the folder, no
  thread traceback;
- an error printed while a progress bar's line is open starts a line of its own;
- train-tokenizer says how many files and folders of its corpus folder it did not read, and how
  many empty documents it skipped (as prepare's summary does).
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

import test_bad_inputs as table
from test_bad_inputs import C, PRETRAIN, SFT_SETS, TOKENIZE, Row, both, conversations, project, write  # noqa: F401

from lmforge.cli import main
from lmforge.fileio import MARKER_FILE, write_marker

ROWS: list[Row] = []


def add(id: str, argv, match: str, damage=None) -> None:
    ROWS.append(Row(id, tuple(argv), match, damage))


def run_folder(name: str, command: str, **files: str):
    """`name`/: the run folder of `command` before its first checkpoint (the marker alone), holding
    a copy of each file of the project given as `inside=source`."""
    def f(p: Path) -> None:
        (p / name).mkdir()
        write_marker(p / name, command)
        for inside, source in files.items():
            shutil.copy(p / source, p / name / inside)
    return f


def unmarked(source: str, copy: str):
    """`copy`/: the lmforge folder `source` as a copy without its marker (another tool's copy)."""
    def f(p: Path) -> None:
        shutil.copytree(p / source, p / copy)
        (p / copy / MARKER_FILE).unlink()
    return f


TASKS = "".join(json.dumps({"query": f"def f{i}(x): return", "choices": [" x", " None"], "gold": 0}) + "\n"
                for i in range(3))
PAIRS = "".join(json.dumps({"prompt": f"{i}: value return self", "chosen": "return value",
                            "rejected": f"return {i}"}) + "\n" for i in range(24))
PROMPTS = "".join(json.dumps({"prompt": f"{i}: value data items", "signature": f"def f{i}(x):"}) + "\n"
                  for i in range(24))


# -- 1. train-tokenizer and import-tokenizer ---------------------------------------------------------
add("train-tokenizer-out-inside-corpus", ("train-tokenizer", *C, "--out", "corpus/tok", "--no-progress"),
    r"--out corpus/tok is inside data\.source = 'corpus'.*Choose another --out")
add("train-tokenizer-out-inside-glob-base", ("train-tokenizer", *C, "--set", "data.source=corpus/*.py", "--out",
                                             "corpus/sub", "--no-progress"),
    r"--out corpus/sub is inside data\.source = 'corpus'")
add("train-tokenizer-out-inside-mixture-source",
    ("train-tokenizer", *C, "--set", "data.source=stdlib", "--set", 'data.sources=[{source = "corpus", weight = 1.0}]',
     "--out", "corpus/tok", "--no-progress"), r"--out corpus/tok is inside data\.sources\[0\]\.source = 'corpus'")

def _user_hf(p: Path) -> None:
    unmarked("hf", "userhf")(p)


IMPORT_TOK = ("import-tokenizer", *C, "--from", "userhf")
add("import-tokenizer-out-inside-from", (*IMPORT_TOK, "--out", "userhf/tok"),
    r"--out userhf/tok is inside --from userhf, a folder this command reads", _user_hf)
add("import-tokenizer-out-inside-corpus", (*IMPORT_TOK, "--out", "corpus/tok"),
    r"--out corpus/tok is inside data\.source = 'corpus'", _user_hf)

# -- 2. training stages ------------------------------------------------------------------------------
EVAL_TASK_SET = ("--set", 'train.eval_tasks=["newrun/t.jsonl"]')
add("pretrain-eval-task-inside-run", (*PRETRAIN[:-3], *EVAL_TASK_SET, "--out", "newrun", "--no-progress"),
    r"--out newrun holds train\.eval_tasks = 'newrun/t\.jsonl'.*Choose another --out",
    both(write("t.jsonl", TASKS), run_folder("newrun", "pretrain", **{"t.jsonl": "t.jsonl"})))
add("pretrain-eval-task-inside-run-dry-run", (*PRETRAIN[:-3], *EVAL_TASK_SET, "--out", "newrun", "--dry-run"),
    r"--out newrun holds train\.eval_tasks = 'newrun/t\.jsonl'",
    both(write("t.jsonl", TASKS), run_folder("newrun", "pretrain", **{"t.jsonl": "t.jsonl"})))
add("pretrain-resume-tokenizer-dir-is-run", ("pretrain", *C, "--set", "tokenizer.dir=run", "--resume", "--out", "run",
                                             "--no-progress"), r"--out run is tokenizer\.dir = 'run'")
add("pretrain-out-inside-unmarked-data", ("pretrain", *C, "--set", "data.dir=userdata", "--out", "userdata/run",
                                          "--no-progress"),
    r"--out userdata/run is inside data\.dir = 'userdata'", unmarked("data", "userdata"))
add("pretrain-out-inside-unmarked-tokenizer", ("pretrain", *C, "--set", "tokenizer.dir=usertok", "--out",
                                               "usertok/run", "--no-progress"),
    r"--out usertok/run is inside tokenizer\.dir = 'usertok'", unmarked("tok", "usertok"))
add("pretrain-data-dir-inside-run", ("pretrain", *C, "--set", "data.dir=newrun/data", "--out", "newrun",
                                     "--no-progress"),
    r"--out newrun holds data\.dir = 'newrun/data'",
    both(run_folder("newrun", "pretrain"), lambda p: shutil.copytree(p / "data", p / "newrun" / "data")))
add("pretrain-out-inside-unmarked-init", ("pretrain", *C, "--set", "train.init=userrun", "--out", "userrun/more",
                                          "--no-progress"),
    r"--out userrun/more is inside train\.init = 'userrun'", unmarked("run", "userrun"))
SFT = ("sft", *C, *SFT_SETS)
add("sft-data-inside-run", (*SFT, "--set", "sft.data=newsft/chat.jsonl", "--out", "newsft", "--no-progress"),
    r"--out newsft holds sft\.data = 'newsft/chat\.jsonl'", run_folder("newsft", "sft", **{"chat.jsonl": "chat.jsonl"}))
add("sft-resume-data-inside-run", (*SFT, "--set", "sft.data=sft/mine.jsonl", "--resume", "--out", "sft",
                                   "--no-progress"),
    r"--out sft holds sft\.data = 'sft/mine\.jsonl'", lambda p: shutil.copy(p / "chat.jsonl", p / "sft" / "mine.jsonl"))
add("sft-eval-task-inside-run", (*SFT, "--set", 'train.eval_tasks=["newsft/t.jsonl"]', "--out", "newsft",
                                 "--no-progress"),
    r"--out newsft holds train\.eval_tasks = 'newsft/t\.jsonl'",
    both(write("t.jsonl", TASKS), run_folder("newsft", "sft", **{"t.jsonl": "t.jsonl"})))
add("sft-tokenizer-dir-is-out", (*SFT, "--set", "tokenizer.dir=newsft", "--out", "newsft", "--no-progress"),
    r"--out newsft is tokenizer\.dir = 'newsft'",
    run_folder("newsft", "sft", **{n: f"run/{n}" for n in ("tokenizer.json", "tokenizer_config.json",
                                                              "contract.json")}))
add("sft-out-inside-unmarked-init", (*SFT, "--set", "sft.init=userrun", "--out", "userrun/sft", "--no-progress"),
    r"--out userrun/sft is inside sft\.init = 'userrun'", unmarked("run", "userrun"))
DPO = ("dpo", *C, "--set", "dpo.init=sft", "--set", "dpo.steps=1", "--set", "dpo.micro_batch_size=2", "--set",
       "dpo.val_examples=0", "--set", "data.val_fraction=0.25")
add("dpo-data-inside-run", (*DPO, "--set", "dpo.data=newdpo/pairs.jsonl", "--out", "newdpo", "--no-progress"),
    r"--out newdpo holds dpo\.data = 'newdpo/pairs\.jsonl'",
    both(write("pairs.jsonl", PAIRS), run_folder("newdpo", "dpo", **{"pairs.jsonl": "pairs.jsonl"})))
RL = ("rl", *C, "--set", "rl.init=sft", "--set", "rl.steps=1", "--set", "rl.micro_batch_size=2", "--set",
      "rl.group_size=2", "--set", "rl.max_new_tokens=4", "--set", "rl.val_examples=0", "--set",
      "data.val_fraction=0.25")
add("rl-data-inside-run-dry-run", (*RL, "--set", "rl.data=newrl/prompts.jsonl", "--out", "newrl", "--dry-run"),
    r"--out newrl holds rl\.data = 'newrl/prompts\.jsonl'",
    both(write("prompts.jsonl", PROMPTS), run_folder("newrl", "rl", **{"prompts.jsonl": "prompts.jsonl"})))

# -- 3. the speedrun -----------------------------------------------------------------------------------
add("speedrun-out-inside-corpus", ("speedrun", *C, "--out", "corpus/sp", "--no-progress"),
    r"--out corpus/sp is inside data\.source = 'corpus'")
add("speedrun-corpus-inside-out", ("speedrun", *C, "--set", "data.source=sp/corpus", "--out", "sp", "--no-progress"),
    r"--out sp holds data\.source = 'sp/corpus'",
    both(run_folder("sp", "speedrun"), lambda p: shutil.copytree(p / "corpus", p / "sp" / "corpus")))
add("speedrun-eval-task-inside-out", ("speedrun", *C, "--set", 'train.eval_tasks=["sp/t.jsonl"]', "--out", "sp",
                                      "--no-progress"),
    r"--out sp holds train\.eval_tasks = 'sp/t\.jsonl'",
    both(write("t.jsonl", TASKS), run_folder("sp", "speedrun", **{"t.jsonl": "t.jsonl"})))

# -- 4. conversation records of two forms ---------------------------------------------------------------
MSGS = conversations(1)[0]["messages"]
SHARE = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
ALPACA = {"instruction": "say hi", "input": "", "output": "hello"}
for id, record, words in [
    ("messages-and-conversations", {"messages": MSGS, "conversations": SHARE},
     r"OpenAI \('messages'\).*ShareGPT \('conversations'\)"),
    ("messages-and-alpaca", {"messages": MSGS, **ALPACA}, r"OpenAI \('messages'\).*Alpaca \('instruction', 'input', "
                                                          r"'output'\)"),
    ("conversations-and-alpaca", {"conversations": SHARE, "output": "x"}, r"ShareGPT.*Alpaca \('output'\)"),
    ("all-three", {"messages": MSGS, "conversations": SHARE, "instruction": "x", "output": "y"},
     r"OpenAI.*ShareGPT.*Alpaca"),
]:
    lines = "".join(json.dumps(c) + "\n" for c in conversations(3)) + json.dumps(record) + "\n"
    add(f"sft-record-{id}", (*SFT, "--set", "sft.data=two.jsonl", "--out", "newsft", "--no-progress"),
        rf"two\.jsonl:4: .*more than one form.*{words}.*Remove", write("two.jsonl", lines))

# preference records: the explicit form ("prompt") with whole conversations as its answers (the
# implicit form's) is refused, never read as either (data/preferences.py reads no other form)
WHOLE = {"prompt": "say hi", "chosen": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi"}],
         "rejected": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "no"}]}
add("dpo-record-explicit-with-implicit-answers", (*DPO, "--set", "dpo.data=both.jsonl", "--out", "newdpo",
                                                  "--no-progress"),
    r"both\.jsonl:25: chosen holds 2 messages.*\"prompt\"", write("both.jsonl", PAIRS + json.dumps(WHOLE) + "\n"))


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_refused_cleanly(row: Row, project, tmp_path, monkeypatch, capsys):
    table.test_bad_input_is_refused_cleanly(row, project, tmp_path, monkeypatch, capsys)


def test_the_rows_cover_every_command():
    assert len({r.id for r in ROWS}) == len(ROWS) >= 20
    assert {r.argv[0] for r in ROWS} >= {"train-tokenizer", "import-tokenizer", "pretrain", "sft", "dpo", "rl",
                                         "speedrun"}


# -- what must still work ------------------------------------------------------------------------------
def test_a_run_beside_its_inputs_and_a_resume_still_work(project, tmp_path, monkeypatch, capsys):
    """A run folder beside data/ and tok/ (one parent), a run folder inside a pretraining run
    (a run holds others by design), and `--resume` of the run's own folder are no overlaps."""
    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    monkeypatch.chdir(work)
    (work / "t.jsonl").write_text(TASKS)
    capsys.readouterr()
    assert main([*SFT, "--set", 'train.eval_tasks=["t.jsonl"]', "--out", "run/sft", "--no-progress"]) == 0, \
        capsys.readouterr().err[-2000:]
    assert (work / "run" / "sft" / "step_000001").is_dir()
    before = table.tree_hash(work / "run" / "step_000002")
    assert main([*PRETRAIN[:-3], "--set", "train.steps=2", "--resume", "--out", "run", "--no-progress"]) == 0, \
        capsys.readouterr().err[-2000:]
    assert table.tree_hash(work / "run" / "step_000002") == before


def test_a_conversation_of_one_form_with_other_keys_is_read(tmp_path):
    """Keys of no form (an id, a source) and Alpaca's optional "input" beside "messages" alone are
    not a second form: the record is read as the one it is."""
    from lmforge.data.conversations import read_conversations

    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": MSGS, "id": 3, "source": "x"}) + "\n"
                    + json.dumps({**ALPACA, "id": 4}) + "\n"
                    + json.dumps({"messages": MSGS, "input": "context"}) + "\n")
    assert len(read_conversations(path)) == 3


# -- TensorBoard on a disk that fills up ----------------------------------------------------------------
@pytest.mark.parametrize("after", [1, 12], ids=["at-the-start", "during-the-run"])
def test_a_full_disk_under_tensorboard_is_one_clean_error(after, project, tmp_path, monkeypatch, capsys):
    """The writer thread's OSError (ENOSPC) after `after` records: exit 2, one `error:` line naming
    the run's tensorboard folder and the reason, no thread traceback."""
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import record_writer

    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    monkeypatch.chdir(work)
    real = record_writer.RecordWriter.write
    calls = {"n": 0}

    def write(self, data):
        calls["n"] += 1
        if calls["n"] > after:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(record_writer.RecordWriter, "write", write)
    capsys.readouterr()
    rc = main([*PRETRAIN[:-3], "--set", "train.tensorboard=true", "--set", "train.steps=4", "--out", "newrun",
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2, err[-3000:]
    assert "Traceback" not in err and "Exception in thread" not in err and err.count("error:") == 1, err[-3000:]
    assert re.search(r"error: newrun/tensorboard: .*No space left on device.*train\.tensorboard", err), err[-1000:]
    assert calls["n"] > after


# -- the error line after an open progress bar ---------------------------------------------------------
def test_an_error_after_an_open_progress_bar_starts_its_own_line(project, tmp_path, monkeypatch, capsys):
    """A bar still open when the error is printed (held by the traceback): its line is ended first,
    and it draws nothing after the error."""
    from tqdm import tqdm

    import lmforge.stages
    from lmforge.errors import DataError

    def stage(*args, **kwargs):
        bar = tqdm(total=10, desc="prepare", file=sys.stderr)
        bar.update(3)
        raise DataError("corpus/x.jsonl:3: damaged")

    monkeypatch.setattr(lmforge.stages, "prepare_stage", stage)
    monkeypatch.chdir(project)
    capsys.readouterr()
    assert main(["prepare", *C, "--out", "newdata"]) == 2
    import gc

    gc.collect()  # the bar, freed with the traceback, is closed: nothing more after the error
    err = capsys.readouterr().err
    assert "prepare:" in err, err
    assert re.search(r"\nerror: corpus/x\.jsonl:3: damaged\n$", err), repr(err[-300:])


def test_no_newline_is_added_without_an_open_bar(project, monkeypatch, capsys):
    import lmforge.stages
    from lmforge.errors import DataError

    def stage(*args, **kwargs):
        raise DataError("no bar")

    monkeypatch.setattr(lmforge.stages, "prepare_stage", stage)
    monkeypatch.chdir(project)
    capsys.readouterr()
    assert main(["prepare", *C, "--out", "newdata"]) == 2
    assert capsys.readouterr().err == "error: no bar\n"


# -- train-tokenizer names what its corpus folder does not read -----------------------------------------
def test_train_tokenizer_counts_what_the_folder_does_not_read(project, tmp_path, monkeypatch, capsys):
    """The counts prepare's summary gives (skipped_other, empty documents), on the tokenizer's line."""
    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    (work / "corpus" / "notes.csv").write_text("a,b\n")
    (work / "corpus" / ".cache").mkdir()
    (work / "corpus" / "empty.py").write_text("")
    monkeypatch.chdir(work)
    capsys.readouterr()
    assert main(list(TOKENIZE)) == 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("tokenizer:"))
    assert "1 empty documents skipped" in line, line
    assert "2 other files or folders not read (skipped_other)" in line, line
    assert "corpus/.cache" in line and "corpus/notes.csv" in line, line
