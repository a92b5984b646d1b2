"""Issue 53, defects a bad-input hunt found around `lmforge rl`'s rewards and the sandbox:

- a reward of yours cannot outlive `rl.reward_timeout_s`, whatever it does with SIGALRM, timers,
  handlers or `except:`; a thread it leaves does not keep the process alive; `os._exit` is a
  RewardError naming it, a fork does not double the caller (each in a fresh interpreter where it
  would end or double the test's own);
- rl_data.json counts the prompts the start-up line counts (after the too-long ones are left out);
- reward names that differ by spaces only are one reward listed twice (refused, as exact twins);
- a prompt field named `completions` / `prompts` is the data file's error, not the reward's;
- a Ctrl-C during `sandbox.Pool.map` stops its interpreters at once;
- `run_job` takes any identifier Python defines as it is spelled (`fé`), and refuses the rest.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lmforge.data.prompts import Prompt, read_prompts
from lmforge.errors import ConfigError, DataError
from lmforge.sandbox import run_job
from lmforge.scorers.rewards import RewardError, Rewards

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # tests/rl_rewards.py: "a user's own" rewards
import rl_rewards  # noqa: E402

HOSTILE = "rl_rewards:hostile"
SRC = str(TESTS.parent / "src")


@pytest.fixture(autouse=True)
def _fresh_plan(monkeypatch):
    monkeypatch.setattr(rl_rewards, "CALLS", {"hostile": 0})
    monkeypatch.setattr(rl_rewards, "PLAN", {})


def a_prompt(i: int = 0, **fields) -> Prompt:
    return Prompt([{"role": "user", "content": f"def f{i}(x):"}], f"p.jsonl:{i + 1}", f"k{i}", fields)


def score_with(action, n: int = 2, timeout_s: float = 0.2):
    """Rewards([HOSTILE]) scoring n completions, its first call doing `action(completions)` first."""
    rl_rewards.PLAN[1] = action
    rw = Rewards([HOSTILE], timeout_s)
    try:
        return rw.score([a_prompt(i) for i in range(n)], ["a"] * n, [True] * n)
    finally:
        rw.close()


def _own_alarm(completions):  # the common pattern: a reward that times itself with SIGALRM
    def expired(signum, frame):
        raise TimeoutError("my own limit")

    signal.signal(signal.SIGALRM, expired)
    signal.alarm(5)
    try:
        time.sleep(3)
    finally:
        signal.alarm(0)


def _timer_off(completions):
    signal.setitimer(signal.ITIMER_REAL, 0)
    time.sleep(3)


def _alarm_ignored(completions):
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    time.sleep(3)


@pytest.mark.parametrize("action", [_own_alarm, _timer_off, _alarm_ignored],
                         ids=["alarm-then-alarm-0", "setitimer-0", "SIGALRM-ignored"])
def test_a_reward_cannot_outlive_its_limit_whatever_it_does_with_sigalrm(action):
    before = signal.getsignal(signal.SIGALRM)
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"'rl_rewards:hostile' did not return within 0\.4 s \(rl\.reward_timeout_s "
                                          r"= 0\.2 s per completion, 2 completions; first prompt p\.jsonl:1\)"):
        score_with(action)
    assert time.monotonic() - t0 < 2.5  # the reward's own 3 s are not waited for
    assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert score_with(lambda c: [0.5] * len(c)).total == [0.5, 0.5]  # in time: nothing changes


def run_script(body: str, timeout: float = 90) -> tuple[subprocess.CompletedProcess, float]:
    """`body` after a prelude that defines `score(action, n=2, timeout_s=5.0)` (as above), in a fresh
    interpreter: (its completed process, its seconds)."""
    prelude = f"""
        import os, signal, sys, threading, time
        sys.path[:0] = [{SRC!r}, {str(TESTS)!r}]
        import rl_rewards
        from lmforge.data.prompts import Prompt
        from lmforge.scorers.rewards import RewardError, Rewards

        def score(action, n=2, timeout_s=5.0):
            rl_rewards.PLAN[1] = action
            rw = Rewards(["rl_rewards:hostile"], timeout_s)
            prompts = [Prompt([{{"role": "user", "content": "x"}}], f"p.jsonl:{{i + 1}}", f"k{{i}}", {{}})
                       for i in range(n)]
            try:
                return rw.score(prompts, ["a"] * n, [True] * n)
            finally:
                rw.close()
    """
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(prelude) + textwrap.dedent(body)],
                          capture_output=True, text=True, timeout=timeout, cwd=TESTS.parent)
    return done, time.monotonic() - t0


def test_a_reward_that_swallows_every_stop_forever_is_still_stopped():
    done, seconds = run_script("""
        def forever(completions):
            while True:
                try:
                    time.sleep(1)
                except:  # noqa: E722 - what a careless reward does
                    pass

        try:
            score(forever, timeout_s=0.5)
        except RewardError as exc:
            print("refused:", exc)
    """)
    assert done.returncode == 0, done.stderr
    assert re.search(r"refused: rl\.rewards = 'rl_rewards:hostile' did not return within 1 s", done.stdout), done
    assert seconds < 60


def test_a_thread_a_reward_leaves_behind_does_not_keep_the_process_alive():
    done, seconds = run_script("""
        def leaves_a_thread(completions):
            threading.Thread(target=time.sleep, args=(600,)).start()  # not a daemon
            return [1.0] * len(completions)

        print("scored", score(leaves_a_thread).total)
    """)
    assert done.returncode == 0 and "scored [1.0, 1.0]" in done.stdout, done
    assert seconds < 60


def test_a_reward_that_calls_os_exit_is_a_reward_error_naming_it():
    done, _ = run_script("""
        try:
            score(lambda c: os._exit(0))
        except RewardError as exc:
            print("refused:", exc)
        print("still here")
    """)
    assert done.returncode == 0, done
    assert re.search(r"refused: rl\.rewards = 'rl_rewards:hostile' ended the process it runs in \(exit status 0, "
                     r"e\.g\. os\._exit\)", done.stdout), done
    assert done.stdout.count("still here") == 1


def test_a_reward_that_forks_does_not_double_its_caller():
    done, _ = run_script("""
        def forks(completions):
            os.fork()  # both copies return
            return [0.25] * len(completions)

        me = os.getpid()
        scored = score(forks)
        print("scored", scored.total, os.getpid() == me)
        scored = score(lambda c: [0.5] * len(c))  # and it goes on as before
        print("scored", scored.total, os.getpid() == me)
    """)
    assert done.returncode == 0, done
    assert done.stdout.splitlines() == ["scored [0.25, 0.25] True", "scored [0.5, 0.5] True"], done


# -- rl_data.json -------------------------------------------------------------------------------------
def test_rl_data_json_counts_the_prompts_the_start_up_line_counts(tiny_run, init_ckpt, tmp_path, monkeypatch, capsys):
    from test_rl import rl_cfg

    from lmforge.stages import rl as rl_module

    cfg, _ = tiny_run
    prompts = {"train": [a_prompt(i) for i in range(6)]
               + [Prompt([{"role": "user", "content": "def g(x):" + " x" * 4000}], "too:long", "long", {})],
               "val": []}
    monkeypatch.setattr(rl_module, "load_prompts", lambda c: (prompts, {"source": "stdlib",
                                                                        "prompts": {"train": 7, "val": 0}}))
    run = tmp_path / "run"
    rl_module.rl_stage(rl_cfg(cfg, init_ckpt, "stdlib", steps=1), run, progress=False)
    info = json.loads((run / "rl_data.json").read_text())
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("rl data:")]
    assert line and "6 training prompts, 0 held out; 1 left out" in line[0], line
    assert info["prompts"] == {"train": 6, "val": 0} and info["too_long"] == {"train": 1, "val": 0}


# -- reward names ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("names", [["rl_rewards:short", "rl_rewards: short"],
                                   ["rl_rewards:short", " rl_rewards:short "],
                                   ["rl_rewards :short", "rl_rewards:short"]])
def test_reward_names_that_differ_by_spaces_are_one_reward_listed_twice(names):
    with pytest.raises(ConfigError, match=r"are the same reward \(spaces aside\); list each once"):
        Rewards(names)
    with pytest.raises(ConfigError, match="a reward appears twice"):  # as exact twins are, by the config
        from lmforge.config import load_config
        load_config(None, ['rl.rewards=["parses", "parses"]'])


# -- a prompt field named as a reward's argument -----------------------------------------------------
@pytest.mark.parametrize("field", ["completions", "prompts"])
def test_a_prompt_field_named_completions_or_prompts_is_the_data_files_error(field, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "def f(x):"}) + "\n" + json.dumps({"prompt": "def g(x):", field: "x"}) + "\n")
    with pytest.raises(DataError, match=rf"p\.jsonl:2: a field named \"{field}\": every reward already receives "
                                        rf"{field}=.*Rename the field in the file"):
        read_prompts(path)
    rw = Rewards(["rl_rewards:short"])
    try:  # prompts made in Python: the same blame, naming the prompt
        with pytest.raises(DataError, match=rf"p\.jsonl:2: the prompt has a field named '{field}'.*Rename the field"):
            rw.score([a_prompt(0), a_prompt(1, **{field: "x"})], ["a", "b"], [True, True])
    finally:
        rw.close()


# -- Ctrl-C during Pool.map ---------------------------------------------------------------------------
def test_ctrl_c_during_pool_map_stops_the_running_interpreters_at_once():
    done, seconds = run_script("""
        from lmforge.sandbox import Pool
        job = {"kind": "cases", "module": "", "function": "slow", "cases": [["(1,)", "1"]],
               "source": "def slow(x):\\n    import time\\n    time.sleep(50)\\n    return x\\n"}
        pool = Pool(workers=2, timeout=60)
        pool.map([{**job, "source": "def slow(x):\\n    return x\\n"}])  # the interpreters are started
        threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        try:
            pool.map([job] * 4)
        except KeyboardInterrupt:
            print(f"interrupted after {time.monotonic() - t0:.1f} s")
        pool.close()
    """, timeout=120)
    assert done.returncode == 0 and "interrupted after" in done.stdout, done
    assert seconds < 25  # before: the process waited for its jobs' 50 s at exit


# -- run_job's names -----------------------------------------------------------------------------------
def test_run_job_takes_any_identifier_and_refuses_the_rest():
    job = {"kind": "cases", "module": "", "function": "fé", "source": "def fé(x):\n    return 2 * x\n",
           "cases": [["(3,)", "6"]]}
    assert run_job(job).verdict == "PASS"
    for bad in ("1x", "a-b", "f é", "class", "\ufb01", ""):  # the ligature "ﬁ" would define "fi"
        with pytest.raises(ValueError, match=r"job\['function'\] = .*: expected an identifier"):
            run_job({**job, "function": bad})
    with pytest.raises(ValueError, match=r"job\['module'\] = 'os\.1x'"):
        run_job({**job, "module": "os.1x"})
