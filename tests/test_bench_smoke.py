"""The benchmarks in bench/ cannot rot.

- Every benchmark's `--smoke` mode (seconds, tiny sizes) runs as its own script in a
  subprocess: exit 0, a table printed, nothing recorded in bench/RESULTS.md, nothing
  written to the benchmark caches; decode and training parity with transformers hold.
- A runtime that crashes (SIGSEGV, SIGILL, abort) in a `common.Child` is a reported status,
  not the end of the benchmark: tested with children that kill themselves, without llama.cpp;
  bench_gguf turns such a crash into a row of its table.
- run_all.py goes on past a benchmark that raises or crashes, reports it, and exits 1.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import common  # noqa: E402
import run_all  # noqa: E402

#: a Markdown table: a header row, then its |---| rule
TABLE = re.compile(r"^\|.*\|\n\|[-|]+\|$", re.M)
PYTHON_CHILD = [sys.executable, "-c"]
#: a child that answers as a `common.Child` expects (bench/ on its path)
SERVING_CHILD = f"import sys; sys.path.insert(0, {str(BENCH)!r}); import common, os, signal\n"


def digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def cache_files() -> set[Path]:
    """Every file under the benchmark caches (a smoke run must add none)."""
    return {p for d in (common.CACHE, ROOT / "runs" / "bench-quality") if d.is_dir() for p in d.rglob("*")}


def smoke_env() -> dict:
    """One torch thread: tiny ops on a shared 2-core machine only wait for each other with two."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


# -- each benchmark's smoke mode ---------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", run_all.discover())
def test_smoke_mode_runs_and_prints_its_table(name, tmp_path):
    results, caches = digest(run_all.RESULTS), cache_files()
    script = run_all.bench_path(name)
    res = subprocess.run([sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=smoke_env())
    assert res.returncode == 0, f"{script.name} --smoke exited {res.returncode}:\n{res.stderr[-4000:]}"
    out = res.stdout
    assert TABLE.search(out), f"{script.name} --smoke printed no table:\n{out[-2000:]}"
    assert "SMOKE RUN" in out  # its figures are labelled as meaningless
    assert digest(run_all.RESULTS) == results and cache_files() == caches
    assert list(tmp_path.iterdir()) == []  # nothing left in its working directory either
    CHECKS.get(name, lambda out: None)(out)


def check_finetune(out: str) -> None:
    """Both sides trained the same tiny model on the same conversations: each arm has its figures,
    and the held-out losses (each side's own scorer, after 3 steps from the same weights) agree;
    lmforge with activation checkpointing (`-ac`) ends at the same loss to the last digit shown
    (its gradients are the same bit for bit)."""
    rows = dict(re.findall(r"^\| (lmforge-lora|lmforge-lora-ac|trl-lora) +\| [\d,]+ +\| [\d,]+ +\| ([\d.]+) +\|",
                           out, re.M))
    assert set(rows) == {"lmforge-lora", "lmforge-lora-ac", "trl-lora"}, out
    assert abs(float(rows["lmforge-lora"]) - float(rows["trl-lora"])) < 0.05, rows
    assert rows["lmforge-lora"] == rows["lmforge-lora-ac"], rows


def check_decode(out: str) -> None:
    """lmforge's greedy ids equal transformers' (the exporter's Qwen3 twin), batch 1 and left-padded batch 3."""
    assert "Qwen3ForCausalLM" in out
    rows = re.findall(r"^\| (\d+) +\|.*\| (True|False) +\|$", out, re.M)
    assert rows == [("1", "True"), ("3", "True")], out


def check_train(out: str) -> None:
    """Same weights, same batch: the first-step losses agree (fp32 exactly up to summation order)."""
    pairs = re.findall(r"smoke (fp32|bf16): .* first-step loss lmforge ([\d.]+) vs transformers ([\d.]+)", out)
    assert sorted(p[0] for p in pairs) == ["bf16", "fp32"], out
    for precision, ours, theirs in pairs:
        assert abs(float(ours) - float(theirs)) < (1e-4 if precision == "fp32" else 5e-3), (precision, ours, theirs)


def check_gguf(out: str) -> None:
    """lmforge's side runs and the export writes both files; without llama.cpp its rows say so."""
    assert re.search(r"^\| lmforge +\| [\d.]+ ", out, re.M), out
    for name in ("llama.cpp f32", "llama.cpp q8_0"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {name} "))
        assert re.search(r"\| \d+\.\d +\|$", row), row  # the GGUF file's size
        if not __import__("bench_gguf").llama_installed():
            assert "llama.cpp not installed" in row


def check_quality(out: str) -> None:
    per_seed, _, over = out.partition("### Over seeds")  # the per-seed table, then the one over seeds
    row = r"^\| (?:lmforge|reference[^|]*) +\| \d+ +\| ([\d.]+) "
    bpb = [float(x) for x in re.findall(row, per_seed, re.M)]
    assert len(bpb) == 2 and all(0 < b < 20 for b in bpb), out
    assert [float(x) for x in re.findall(row, over.split("###")[0], re.M)] == bpb, out  # 1 seed: mean = it


def check_align(out: str) -> None:
    """DPO and RL of the same tiny model on both sides: every arm has a row with its figures; the first
    DPO step's loss is ln 2 on both sides (policy = reference before the first update), and its mean
    log p of the chosen replies agrees (the same pairs in the same order, the same weights); the RL
    arms' rewards are in [0, 1] and their completions within the 12-token budget; lmforge with
    activation checkpointing (`lmforge-dpo-ac`) ends at the same loss to the last digit shown."""
    num = r"[\d,]+(?:\.\d+)?"
    dpo = dict((arm, (float(first), float(logp))) for arm, first, logp in re.findall(
        rf"^\| (lmforge-dpo|trl-dpo) +\| {num} +\| {num} +\| {num} +\| loss ([\d.]+) -> [\d.]+, step 1 log p\(chosen\) "
        r"(-?[\d.]+) +\|", out, re.M))
    rl = dict((arm, (float(r), float(n))) for arm, r, n in re.findall(
        rf"^\| (lmforge-rl|trl-grpo) +\| {num} +\| {num} +\| {num} +\| reward ([\d.]+), ([\d.]+) tokens a completion",
        out, re.M))
    if not __import__("bench_finetune").trl_installed():  # lmforge's rows only; TRL's say it is not installed
        assert set(dpo) == {"lmforge-dpo"} and set(rl) == {"lmforge-rl"} and "trl/peft not installed" in out, out
        return
    assert set(dpo) == {"lmforge-dpo", "trl-dpo"} and set(rl) == {"lmforge-rl", "trl-grpo"}, out
    for arm, (first, _) in dpo.items():
        assert abs(first - 0.6931) < 2e-3, (arm, first)
    ours, theirs = dpo["lmforge-dpo"][1], dpo["trl-dpo"][1]
    assert abs(ours - theirs) < 0.01 * abs(theirs), (ours, theirs)
    for arm, (reward, length) in rl.items():
        assert 0 <= reward <= 1 and 0 < length <= 12, (arm, reward, length)
    assert re.search(r"^\| lmforge-dpo .*\| [\d.]+x faster / [\d.]+x memory +\|$", out, re.M), out
    # with activation checkpointing: the same gradients bit for bit, so the same losses and log p to the digit
    ac = re.search(r"^\| lmforge-dpo-ac .*\| (loss [\d.]+ -> [\d.]+, step 1 log p\(chosen\) -?[\d.]+) +\|", out, re.M)
    plain = re.search(r"^\| lmforge-dpo .*\| (loss [\d.]+ -> [\d.]+, step 1 log p\(chosen\) -?[\d.]+) +\|", out, re.M)
    assert ac and plain and ac.group(1) == plain.group(1), out


CHECKS = {"decode": check_decode, "train": check_train, "gguf": check_gguf, "quality": check_quality,
          "finetune": check_finetune, "align": check_align}


@pytest.mark.slow
@pytest.mark.parametrize("script", ["bench_decode.py", "bench_gguf.py"])
def test_decode_benchmarks_take_a_users_imported_gemma3(script, tmp_path):
    """`--shape gemma3-270m` (its tiny twin in --smoke): transformers saves a Gemma3ForCausalLM folder,
    `lmforge import-hf` imports it; lmforge's greedy ids equal transformers' own generate at batch 1
    and left-padded batch 3, and llama.cpp's on the exported GGUF (f32) where llama.cpp is installed."""
    res = subprocess.run([sys.executable, str(BENCH / script), "--smoke", "--shape", "gemma3-270m"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=smoke_env())
    assert res.returncode == 0, res.stderr[-4000:]
    out = res.stdout
    assert "SMOKE RUN" in out and "vocab 512" in out, out
    if script == "bench_decode.py":
        assert "Gemma3ForCausalLM" in out
        assert re.findall(r"^\| (\d+) +\|.*\| (True|False) +\|$", out, re.M) == [("1", "True"), ("3", "True")], out
        return
    assert re.search(r"^\| lmforge +\| [\d.]+ .*\| 16/16 ", out, re.M), out
    f32 = next(line for line in out.splitlines() if line.startswith("| llama.cpp f32 "))
    if __import__("bench_gguf").llama_installed():
        assert re.search(r"\| 16/16 +\|", f32), f32  # llama.cpp's greedy ids are lmforge's
    else:
        assert "llama.cpp not installed" in f32


@pytest.mark.slow
def test_gpu_check_smoke_runs_its_rows_on_a_cpu_and_a_failing_row_is_a_row(tmp_path):
    """bench/gpu_check.py (issue 48: the GPU path in one prepared check), --smoke on a CPU: rows 2a-2d
    (compiled with aot_eager against eager gradients of pretraining, SFT, DPO and RL), 3 (flex against
    sdpa, forward only here) and 4 (the step against transformers' LlamaForCausalLM) pass, 1 and 5 say
    skipped, one table, the JSON holds each row's figures, nothing is left where it ran. Then a row
    that raises (an unknown compile backend) is a FAIL row with the error's last line in the table,
    and the exit status is 1. About 40 s on 2 quiet cores (75 s when others load them)."""
    import json

    cwd, report = tmp_path / "cwd", tmp_path / "gpu_check.json"
    cwd.mkdir()
    script = str(BENCH / "gpu_check.py")
    res = subprocess.run([sys.executable, script, "--smoke", "--json", str(report)], capture_output=True, text=True,
                         timeout=300, cwd=cwd, env=smoke_env())
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert len(TABLE.findall(res.stdout)) == 1 and "SMOKE RUN" in res.stdout
    rows = {r["row"]: r for r in json.loads(report.read_text())["rows"]}
    grads = ["grads-pretrain", "grads-sft", "grads-dpo", "grads-rl"]
    assert {k: r["status"] for k, r in rows.items()} == {
        "pytest": "SKIP", **{g: "PASS" for g in grads}, "flex": "PASS", "step": "PASS", "speedrun": "SKIP"}, res.stdout
    for g in grads:
        groups = rows[g]["figures"]["groups"]
        assert {"embedding", "attention", "mlp", "norms", "head", "all"} <= set(groups), (g, groups)
        assert groups["all"]["norm"] > 0 and groups["all"]["norm_rel"] < 0.02, (g, groups["all"])
    assert rows["flex"]["figures"]["attention"]["fp32"]["out"] < 1e-4
    step = rows["step"]["figures"]
    assert step["reference"] == "LlamaForCausalLM" and step["matmul_peak_flops"] > 0
    sides = step["sides"]
    assert all(sides[s]["tokens_per_s"]["median"] > 0 and 0 < sides[s]["mfu"] for s in sides)
    assert abs(sides["lmforge"]["first_loss"] - sides["transformers"]["first_loss"]) < 5e-3, sides
    assert list(cwd.iterdir()) == []

    res = subprocess.run([sys.executable, script, "--smoke", "--only", "pretrain", "--compile-backend",
                          "no-such-backend"], capture_output=True, text=True, timeout=300, cwd=cwd, env=smoke_env())
    assert res.returncode == 1, res.stdout[-4000:] + res.stderr[-4000:]
    failed = r"^\| 2a +\| [^|]+\| FAIL +\| InvalidBackend: .*'no-such-backend'.*\| \d+ +\|$"
    assert re.search(failed, res.stdout, re.M), res.stdout
    assert "1 of 1 rows failed" in res.stdout and "the end of its log" in res.stdout


# -- children that crash ------------------------------------------------------------------------
@pytest.mark.parametrize("how, status", [
    ("os.kill(os.getpid(), signal.SIGSEGV)", "crashed: SIGSEGV"),
    ("os.kill(os.getpid(), signal.SIGILL)", "crashed: SIGILL"),
    ("os.abort()", "crashed: SIGABRT"),
    ("sys.exit(3)", "exit 3"),
])
def test_a_child_that_dies_is_a_status(how, status):
    with common.Child(PYTHON_CHILD + [f"import os, signal, sys; sys.stderr.write('last words\\n'); {how}"]) as child:
        with pytest.raises(common.ChildFailed) as err:
            child.request({"prompts": [[1, 2]]})
        assert err.value.status == status and "last words" in err.value.detail
        with pytest.raises(common.ChildFailed):  # and stays failed
            child.request({})
        assert child.proc.returncode is not None


def test_a_child_answers_then_crashes_midway():
    code = SERVING_CHILD + textwrap.dedent("""
        seen = []
        def handle(req):
            seen.append(req)
            print("a runtime's log line on stdout")  # must not corrupt the answers
            os.write(1, b"and one written to fd 1\\n")
            if len(seen) == 3:
                os.kill(os.getpid(), signal.SIGSEGV)
            return {"sum": sum(req["xs"]), "n": len(seen)}
        common.serve_requests(lambda: (print("setup: another one"), handle)[1])
    """)
    with common.Child(PYTHON_CHILD + [code]) as child:
        assert child.request({"xs": [1, 2, 3]}) == {"sum": 6, "n": 1}
        assert child.request({"xs": [10]}) == {"sum": 10, "n": 2}
        with pytest.raises(common.ChildFailed) as err:
            child.request({"xs": []})
        assert err.value.status == "crashed: SIGSEGV"
        assert "a runtime's log line on stdout" in err.value.detail and "setup: another one" in err.value.detail


def test_a_child_that_hangs_times_out_and_is_killed():
    with common.Child(PYTHON_CHILD + ["import time; time.sleep(60)"], timeout=1.0) as child:
        with pytest.raises(common.ChildFailed) as err:
            child.request({})
        assert err.value.status == "timed out after 1 s"
        assert child.proc.returncode == -signal.SIGKILL


def test_interleaved_drops_a_crashed_child_and_times_the_rest():
    calls = {"lmforge": 0}

    def ours():
        calls["lmforge"] += 1

    with common.Child(PYTHON_CHILD + ["import os, signal; os.kill(os.getpid(), signal.SIGILL)"]) as child:
        failed: dict[str, str] = {}
        stats = common.interleaved({"lmforge": ours, "llama.cpp": lambda: child.request({})}, 1, 3, failed=failed)
    assert failed == {"llama.cpp": "crashed: SIGILL"}
    assert list(stats) == ["lmforge"] and len(stats["lmforge"].samples) == 3 and calls["lmforge"] == 4
    with pytest.raises(common.ChildFailed):  # without `failed`, the crash is the caller's to handle
        with common.Child(PYTHON_CHILD + ["import os; os.abort()"]) as child:
            common.interleaved({"x": lambda: child.request({})}, 0, 1)


def test_exit_status_names_the_signal():
    assert [common.exit_status(rc) for rc in (-11, -4, -6, 0, 2)] == [
        "crashed: SIGSEGV", "crashed: SIGILL", "crashed: SIGABRT", "exit 0", "exit 2"]


def test_bench_gguf_reports_a_llama_crash_as_a_row(monkeypatch, capsys):
    """llama.cpp crashing on the f32 file at load (SIGSEGV) and on the q8_0 file in the timed round
    after answering the warm-up (SIGILL): both are rows, lmforge's row keeps its figures."""
    import bench_gguf

    midway = SERVING_CHILD + textwrap.dedent("""
        seen = []
        def handle(req):
            seen.append(1)
            if len(seen) == 2:
                os.kill(os.getpid(), signal.SIGILL)
            return {"ids": [[0] * req["new_tokens"] for _ in req["prompts"]]}
        common.serve_requests(lambda: handle)
    """)
    at_load = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    monkeypatch.setattr(bench_gguf, "llama_installed", lambda: True)
    monkeypatch.setattr(bench_gguf, "llama_child_argv",
                        lambda gguf, threads, kv_f32: PYTHON_CHILD + [at_load if kv_f32 else midway])
    results = bench_gguf.main(["--smoke"])
    out = capsys.readouterr().out
    assert results["llama.cpp f32"] == {"status": "crashed: SIGSEGV"}
    assert results["llama.cpp q8_0"] == {"status": "crashed: SIGILL"}
    assert results["lmforge"]["tok_s"] > 0 and results["lmforge"]["agree"] == results["lmforge"]["of"]
    assert re.search(r"^\| llama\.cpp f32 +\| crashed: SIGSEGV +\|", out, re.M), out
    assert re.search(r"^\| llama\.cpp q8_0 +\| crashed: SIGILL +\|", out, re.M), out


FAKE_LLAMA_CPP = """
import os, signal

class Llama:  # llama-cpp-python's Llama, as far as bench_gguf uses it
    def __init__(self, model_path, **kwargs):
        self.path = model_path
        print("llama.cpp log line on stdout")  # the real one logs too; the answers must survive it

    def generate(self, tokens, **kwargs):
        if "q8_0" in self.path:  # its quantized kernels on a CPU that lacks an instruction
            os.kill(os.getpid(), signal.SIGILL)
        i = 0
        while True:
            yield 5 + i % 7
            i += 1
"""


@pytest.mark.slow
def test_bench_gguf_smoke_with_a_llama_cpp_that_crashes_on_q8_0(tmp_path):
    """The real child command (bench_gguf.py --serve-llama) under a stand-in `llama_cpp` module
    that decodes the f32 file and dies with SIGILL on the q8_0 one: exit 0, the f32 row has
    figures, the q8_0 row says crashed: SIGILL."""
    fake = tmp_path / "fake" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_LLAMA_CPP)
    env = smoke_env()
    env["PYTHONPATH"] = os.pathsep.join([str(fake.parent), env["PYTHONPATH"]])
    res = subprocess.run([sys.executable, str(BENCH / "bench_gguf.py"), "--smoke"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    f32_row = r"^\| llama\.cpp f32 +\| [\d.]+ +\| [\d.]+-[\d.]+ +\| [\d.]+x +\| \d+/16 "
    assert re.search(f32_row, res.stdout, re.M), res.stdout
    assert re.search(r"^\| llama\.cpp q8_0 +\| crashed: SIGILL +\|", res.stdout, re.M), res.stdout
    assert re.search(r"^\| lmforge +\| [\d.]+ ", res.stdout, re.M), res.stdout


# -- run_all.py --------------------------------------------------------------------------------
FAKE_BENCHES = {
    "bench_boom.py": "import os, signal\ndef main(argv):\n    print('boom starts')\n"
                     "    os.kill(os.getpid(), signal.SIGSEGV)\n",
    "bench_ok.py": "import common\ndef main(argv):\n"
                   "    print(common.table(['smoke', 'x'], [[str('--smoke' in argv), 1]]))\n    return {'x': 1}\n",
    "bench_raises.py": "def main(argv):\n    raise ValueError('a broken benchmark')\n",
}


@pytest.fixture
def fake_bench(tmp_path, monkeypatch):
    for name, code in FAKE_BENCHES.items():
        (tmp_path / name).write_text(code)
    monkeypatch.setattr(run_all, "BENCH", tmp_path)
    monkeypatch.setattr(run_all, "RESULTS", tmp_path / "RESULTS.md")
    return tmp_path


def test_run_all_goes_on_past_failures_and_exits_1(fake_bench, capsys):
    assert run_all.cli(["--smoke"]) == 1
    out = capsys.readouterr().out
    assert "boom starts" in out  # what it printed before it crashed is kept
    assert "| True  | 1 |" in out  # bench_ok ran after the crash, with --smoke passed on
    assert re.search(r"^\| bench_boom +\| \d+ +\| FAILED: crashed: SIGSEGV +\|$", out, re.M), out
    assert re.search(r"^\| bench_raises +\| \d+ +\| FAILED: ValueError: a broken benchmark +\|$", out, re.M), out
    assert re.search(r"^\| bench_ok +\| \d+ +\| ok +\|$", out, re.M), out
    assert "FAILED: boom, raises" in out
    assert not (fake_bench / "RESULTS.md").exists()  # smoke runs are never recorded


def test_run_all_records_a_full_run_with_its_failures(fake_bench, capsys):
    assert run_all.cli(["--only", "ok"]) == 0
    assert run_all.cli(["--only", "boom,ok"]) == 1
    text = (fake_bench / "RESULTS.md").read_text()
    assert text.count("### bench_ok\n") == 2 and "### bench_boom (FAILED)" in text and "crashed: SIGSEGV" in text
    assert '"x": 1' in text
    with pytest.raises(SystemExit):
        run_all.main(["--smoke", "--record"])


@pytest.mark.slow
def test_against_commit_smoke_loads_the_commit_as_a_second_package(tmp_path):
    """bench/against_commit.py against HEAD: the commit's decode step gives this tree's logits
    exactly (the same code, a second package) and its sampled ids are equal."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    res = subprocess.run([sys.executable, str(BENCH / "against_commit.py"), "HEAD", "--smoke"], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path, env=smoke_env())
    assert res.returncode == 0, res.stderr[-4000:]
    assert "SMOKE RUN" in res.stdout
    assert len(re.findall(r"max \|logit diff\| 0\.0e\+00", res.stdout)) == 2, res.stdout
    assert "ids equal: True" in res.stdout
    assert list(tmp_path.iterdir()) == []
