"""`lmforge rl` against hostile inputs (issue 45): a reward of yours cannot end a run quietly,
and a bad prompts file is refused cleanly.

- A reward that calls sys.exit (at import or on any call), changes the working folder, runs past
  rl.reward_timeout_s or returns something that is not a number in [0, 1] stops the run with
  exit 2 and one line naming it ("module:function"), the completion and the value.
- A signal is a signal: SIGINT/SIGTERM while a reward runs (or a KeyboardInterrupt of its own)
  stops the run as a Ctrl-C does anywhere else in training: exit 130/143, the step finished
  (the reward's call made once more, after the signal), a checkpoint, the --resume line; before
  training, exit 130 with the interruption's line.
- A prompts file: a field lmforge's rewards read with a value of another type, a FIFO, and
  TRL's conversational form {"prompt": [messages]} (accepted, as {"messages": [...]}).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from lmforge.data.prompts import Prompt, read_prompts
from lmforge.errors import DataError
from lmforge.model.io import list_checkpoints
from lmforge.scorers.rewards import RewardError, Rewards
from test_resume import read_metrics
from test_rl import prompts_file, rl_cfg

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/rl_rewards.py: "a user's own" rewards
import rl_rewards  # noqa: E402

HOSTILE = "rl_rewards:hostile"


@pytest.fixture(autouse=True)
def _fresh_plan(monkeypatch, tmp_path):
    monkeypatch.setattr(rl_rewards, "CALLS", {"hostile": 0})
    monkeypatch.setattr(rl_rewards, "PLAN", {})
    monkeypatch.setattr(rl_rewards, "CALLS_FILE", tmp_path / "hostile-calls")


def calls() -> int:
    """The calls of `hostile` so far (made in the reward's own process: counted in CALLS_FILE)."""
    path = rl_rewards.CALLS_FILE
    return len(path.read_text().splitlines()) if path.exists() else 0


def _raise(exc: BaseException):
    raise exc


def _signal_then(sig: int, then=None):
    """An action: this process receives `sig` while the reward runs; then `then` (raised) or nothing."""
    def act(completions):
        os.kill(os.getpid(), sig)
        for _ in range(10**5):  # the handler runs between bytecodes, inside the reward
            pass
        if then is not None:
            raise then
    return act


def run_rl(cfg, out: Path, capsys, *extra: str) -> tuple[int, str]:
    """`lmforge rl` on the command line (in this process): (exit code, stderr)."""
    from lmforge.cli import main

    path = out.parent / f"{out.name}.toml"
    cfg.save(path)
    rc = main(["rl", "--config", str(path), "--out", str(out), "--no-progress", *extra])
    return rc, capsys.readouterr().err


def error_line(err: str) -> str:
    """The one `error:` line of a refused command, no traceback."""
    lines = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def a_prompt(i: int = 0, **fields) -> Prompt:
    return Prompt([{"role": "user", "content": f"def f{i}(x):"}], f"p.jsonl:{i + 1}", f"k{i}", fields)


def score(value, n: int = 2, timeout_s: float = 5.0):
    """Rewards([HOSTILE]) scoring n completions, the reward returning `value` for each."""
    rl_rewards.CALLS["hostile"] = 0
    rl_rewards.PLAN[1] = value if callable(value) else (lambda c: [value] * len(c))
    return Rewards([HOSTILE], timeout_s).score([a_prompt(i) for i in range(n)], ["a"] * n, [True] * n)


# -- sys.exit, a changed working folder, a time limit, a value that is no reward: exit 2 ------------
@pytest.mark.parametrize("plan,sets,message", [
    ({3: lambda c: sys.exit(0)}, {}, r"rl\.rewards = 'rl_rewards:hostile' called sys\.exit\(0\)"),
    ({1: lambda c: sys.exit("bye")}, {}, r"rl\.rewards = 'rl_rewards:hostile' called sys\.exit\('bye'\)"),
    ({1: lambda c: [10**400] * len(c)}, {},
     r"rl\.rewards = 'rl_rewards:hostile' returned an integer of 401 digits for completion 0 "
     r"\(prompt .*p\.jsonl:\d+\)"),
    ({1: lambda c: time.sleep(3)}, {"reward_timeout_s": 0.1},
     r"rl\.rewards = 'rl_rewards:hostile' did not return within 0\.2 s \(rl\.reward_timeout_s = 0\.1 s"),
    ({3: "chdir"}, {}, r"rl\.rewards = 'rl_rewards:hostile' changed the working folder from .* to .*elsewhere"),
], ids=["sys-exit-in-training", "sys-exit-at-the-check", "int-too-large-for-a-float", "time-limit", "chdir"])
def test_a_reward_that_misbehaves_stops_the_run_with_exit_2_naming_it(plan, sets, message, tiny_run, init_ckpt,
                                                                      tmp_path, monkeypatch, capsys):
    cfg, _ = tiny_run
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    plan = {n: (lambda c: os.chdir(tmp_path / "elsewhere")) if a == "chdir" else a for n, a in plan.items()}
    rl_rewards.PLAN.update(plan)
    t0 = time.monotonic()
    rc, err = run_rl(rl_cfg(cfg, init_ckpt, prompts_file(tmp_path / "p.jsonl"), steps=4, rewards=[HOSTILE], **sets),
                     tmp_path / "run", capsys)
    assert rc == 2, err
    assert re.search(message, error_line(err)), err
    assert os.getcwd() == str(tmp_path)  # the working folder is the run's again
    assert time.monotonic() - t0 < 30
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


@pytest.mark.parametrize("source,code,message", [
    ("import sys\nsys.exit(0)\n", 2,
     r"rl\.rewards = 'at_import_exit:f': importing 'at_import_exit' called sys\.exit\(0\)"),
    ("import os\nos.chdir('elsewhere')\n", 2,
     r"rl\.rewards = 'at_import_chdir:f': importing 'at_import_chdir' changed the working folder"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\nfor _ in range(10**5):\n    pass\n", 130, None),
], ids=["exit", "chdir", "sigint"])
def test_what_importing_a_reward_does(source, code, message, tiny_run, init_ckpt, tmp_path, monkeypatch, capsys):
    cfg, _ = tiny_run
    name = {2: "at_import_exit" if "exit" in source else "at_import_chdir", 130: "at_import_sigint"}[code]
    monkeypatch.chdir(tmp_path)  # a module in the current folder, as the README's my_rewards.py
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / f"{name}.py").write_text(source + "\ndef f(completions, **fields):\n"
                                                  "    return [0.0] * len(completions)\n")
    try:
        rc, err = run_rl(rl_cfg(cfg, init_ckpt, prompts_file(tmp_path / "p.jsonl"), rewards=[f"{name}:f"]),
                         tmp_path / "run", capsys)
    finally:
        sys.modules.pop(name, None)
    assert rc == code, err
    assert os.getcwd() == str(tmp_path)
    if message:
        assert re.search(message, error_line(err)), err
    else:  # a signal: the interruption's line, not an error
        assert "interrupted (SIGINT)" in err and "error:" not in err and "Traceback" not in err, err


# -- a signal is a signal ----------------------------------------------------------------------------
def test_sigint_while_the_reward_is_checked_before_training_is_the_interruption(tiny_run, init_ckpt, tmp_path,
                                                                                capsys):
    cfg, _ = tiny_run
    rl_rewards.PLAN[1] = _signal_then(signal.SIGINT)
    rc, err = run_rl(rl_cfg(cfg, init_ckpt, prompts_file(tmp_path / "p.jsonl"), rewards=[HOSTILE]),
                     tmp_path / "run", capsys)
    assert rc == 130, err
    assert "interrupted (SIGINT)" in err and "error:" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("sig,action", [
    (signal.SIGINT, lambda c: _raise(KeyboardInterrupt())),
    (signal.SIGINT, _signal_then(signal.SIGINT, subprocess.CalledProcessError(-2, ["scorer"]))),
    (signal.SIGTERM, _signal_then(signal.SIGTERM, subprocess.CalledProcessError(-15, ["scorer"]))),
    (signal.SIGINT, _signal_then(signal.SIGINT)),
], ids=["its-own-KeyboardInterrupt", "failed-by-SIGINT", "failed-by-SIGTERM", "SIGINT-while-it-runs"])
def test_a_signal_while_a_reward_runs_stops_after_the_step_with_a_checkpoint(sig, action, tiny_run, init_ckpt,
                                                                            tmp_path, capsys):
    cfg, _ = tiny_run
    c = rl_cfg(cfg, init_ckpt, prompts_file(tmp_path / "p.jsonl"), steps=4, rewards=[HOSTILE])
    rl_rewards.PLAN[3] = action  # step 2's rollouts (call 1 is the check before training)
    run = tmp_path / "run"
    rc, err = run_rl(c, run, capsys)
    assert rc == 128 + sig, err
    assert "error:" not in err and "Traceback" not in err, err
    assert f"stopped at step 2 of 4 ({sig.name}); checkpoint written to {run / 'step_000002'}" in err, err
    assert "run the same command again with --resume" in err
    assert [p.name for p in list_checkpoints(run)] == ["step_000002"]
    assert calls() == 4  # step 2's call made once more, after the signal
    rl_rewards.PLAN.clear()  # the resumed run's reward process counts its calls from 1 again
    rc, err = run_rl(c, run, capsys, "--resume")
    assert rc == 0, err
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4]


# -- what a reward returns ---------------------------------------------------------------------------
@pytest.mark.parametrize("value,shown", [
    (float("nan"), "nan"), (float("inf"), "inf"), (-0.5, "-0.5"), (1.5, "1.5"), (10**400, "an integer of 401 digits"),
    (10**5000, "an integer of about 5001 digits"), (Fraction(10**400), "Fraction"), (True, "True"),
    (np.bool_(False), "np.False_|False"), ("0.5", "'0.5'"), ([0.5], r"\[0\.5\]"), (1j, "1j"),
], ids=["nan", "inf", "negative", "above-1", "int-401-digits", "int-5001-digits", "huge-fraction", "bool",
        "numpy-bool", "string", "list", "complex"])
def test_every_value_that_is_not_a_reward_is_refused_naming_it(value, shown):
    with pytest.raises(RewardError, match=rf"rl\.rewards = 'rl_rewards:hostile' returned .*({shown}).* for "
                                          rf"completion 0 \(prompt p\.jsonl:1\): expected a number in \[0, 1\]"):
        score(value)


@pytest.mark.parametrize("value,want", [
    (np.float32(0.25), 0.25), (np.float64(0.5), 0.5), (np.int64(1), 1.0), (Fraction(1, 2), 0.5), (0, 0.0), (1, 1.0),
])
def test_numbers_of_any_numeric_type_are_rewards(value, want):
    scored = score(value)
    assert scored.total == [want, want] and scored.each[HOSTILE] == [want, want]
    assert all(type(v) is float for v in scored.each[HOSTILE])


def test_a_reward_past_its_time_limit_is_stopped_even_if_it_swallows_the_stop():
    def swallows(completions):
        try:
            time.sleep(2)
        except BaseException:  # noqa: BLE001 - what a careless reward does
            pass
        return [0.5] * len(completions)

    before = signal.getsignal(signal.SIGALRM)
    for action in (lambda c: time.sleep(2), swallows):
        t0 = time.monotonic()
        with pytest.raises(RewardError, match=r"'rl_rewards:hostile' did not return within 0\.4 s \(rl\."
                                              r"reward_timeout_s = 0\.2 s per completion, 2 completions; "
                                              r"first prompt p\.jsonl:1\)"):
            score(action, timeout_s=0.2)
        assert time.monotonic() - t0 < 1.5
        assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert score(lambda c: [0.5] * len(c), timeout_s=0.2).total == [0.5, 0.5]  # in time: nothing changes


def test_a_reward_module_in_the_current_folder_puts_it_on_sys_path_once(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    folders = []
    for name in ("in_folder_a", "in_folder_b"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / f"{name}.py").write_text("def f(completions, **fields):\n    return [1.0] * len(completions)\n")
        folders.append(str(folder))
        monkeypatch.chdir(folder)
        try:
            for _ in range(3):
                Rewards([f"{name}:f"])
        finally:
            sys.modules.pop(name, None)
        assert sys.path.count(str(folder)) == 1
    assert sum(p in folders for p in sys.path) == 1  # the folder lmforge added follows the current one
    monkeypatch.setattr(sys, "path", ["", *[p for p in sys.path if p not in folders]])  # "" is the current folder
    (tmp_path / "in_folder_b" / "in_folder_c.py").write_text("def f(completions, **fields):\n    return [1.0]\n")
    try:
        Rewards(["in_folder_c:f"])
    finally:
        sys.modules.pop("in_folder_c", None)
    assert not any(p in folders for p in sys.path)


# -- prompt files ------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("signature", 5), ("module", ["os"]), ("qualname", None),
                                         ("reference", 1.5)])
def test_a_field_lmforge_reads_with_a_value_of_another_type_is_refused(field, value, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "def f(x):"}) + "\n"
                    + json.dumps({"prompt": "def g(x):", field: value}) + "\n")
    with pytest.raises(DataError, match=rf"p\.jsonl:2: \"{field}\" is {re.escape(repr(value))}; expected a string"):
        read_prompts(path)


def test_a_bad_signature_in_a_prompts_file_exits_2_naming_the_line(tiny_run, init_ckpt, tmp_path, capsys):
    cfg, _ = tiny_run
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"def f{i}(x):", "signature": 5 if i == 3 else f"def f{i}(x):"})
                            + "\n" for i in range(8)))
    rc, err = run_rl(rl_cfg(cfg, init_ckpt, path, rewards=["static"]), tmp_path / "run", capsys)
    assert rc == 2 and re.search(r"p\.jsonl:4: \"signature\" is 5; expected a string", error_line(err)), err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_as_rl_data_is_refused_as_what_it_is(tmp_path):
    from lmforge.config import load_config
    from lmforge.stages.rl import load_prompts

    fifo = tmp_path / "p.jsonl"
    os.mkfifo(fifo)
    cfg = load_config(None, [f"rl.data={fifo}"])
    with pytest.raises(DataError) as info:
        load_prompts(cfg)  # never opened: a FIFO without a writer would block
    text = str(info.value)
    assert "does not exist" not in text and "a FIFO (a named pipe), not a regular file" in text and "p.jsonl" in text
    with pytest.raises(DataError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")


def test_trls_conversational_prompt_form_is_taken_as_messages(tiny_run, init_ckpt, tmp_path):
    from lmforge.stages.rl import rl_stage

    turns = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "def f(x):"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": [*turns[:1], {"role": "user", "content": f"def f{i}(x):"}],
                                        "answer": str(i)}) + "\n" for i in range(8)))
    same = tmp_path / "m.jsonl"
    same.write_text("".join(json.dumps({"messages": [*turns[:1], {"role": "user", "content": f"def f{i}(x):"}],
                                        "answer": str(i)}) + "\n" for i in range(8)))
    got, want = read_prompts(path), read_prompts(same)
    assert [(p.messages, p.key, p.fields) for p in got] == [(p.messages, p.key, p.fields) for p in want]
    assert got[0].messages == [*turns[:1], {"role": "user", "content": "def f0(x):"}]
    cfg, _ = tiny_run
    last = rl_stage(rl_cfg(cfg, init_ckpt, path, steps=1), tmp_path / "run", progress=False)
    assert last["step"] == 1
    for record, message in [
        ({"prompt": []}, r"bad\.jsonl:1: \"prompt\" is an empty list"),
        ({"prompt": [*turns, {"role": "assistant", "content": "x"}]},
         r"bad\.jsonl:1: the last message is 'assistant': a prompt ends with the user's turn"),
        ({"prompt": 5}, r"bad\.jsonl:1: prompt is 5; expected a string or a list of messages"),
        ({"prompt": [{"role": "user"}]}, r"bad\.jsonl:1: .*message 0"),
    ]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps(record) + "\n")
        with pytest.raises(DataError, match=message):
            read_prompts(bad)
