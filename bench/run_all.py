"""Run every benchmark in bench/ (`make bench`), print their tables, and append them to
bench/RESULTS.md with the date, the machine and the configuration.

Each `bench/bench_*.py` module (and bench/quality.py) exposes `main(argv)` that prints its
table(s) and returns a dict. Each runs in a child process of its own (this script again,
with `--child`), so that one that fails — an exception, a crash (SIGSEGV, SIGILL, abort),
a hang past `--timeout` — is reported ("bench_gguf: crashed: SIGILL") and the others still
run; the exit status is 1 when any failed. Modules that are missing are skipped. Known
benchmarks run in a fixed order (train, data, tokenizer, masking, decode, quality), then
any other bench_*.py in name order.

Usage:
    python bench/run_all.py                  # everything, recorded in bench/RESULTS.md
    python bench/run_all.py --only train,data
    python bench/run_all.py --quick          # shorter runs of train/data/tokenizer; not recorded
    python bench/run_all.py --smoke          # every benchmark's --smoke (seconds each); never recorded
    python bench/run_all.py --no-record      # print only
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import common  # noqa: E402

ORDER = ["train", "data", "tokenizer", "masking", "decode", "quality"]
RESULTS = BENCH / "RESULTS.md"
#: --quick arguments for the benchmarks that take them (main(argv))
QUICK_ARGS = {
    "train": ["--configs", "speedrun", "--warmup", "1", "--repeat", "2", "--no-profile"],
    "data": ["--warmup", "0", "--repeat", "1", "--sizes", "2,10"],
    "tokenizer": ["--repeat", "1"],
    "quality": ["--steps", "10", "--no-sliding"],
}


def discover() -> list[str]:
    found = sorted(p.stem[len("bench_"):] for p in BENCH.glob("bench_*.py"))
    found += ["quality"] if (BENCH / "quality.py").is_file() else []  # bench/quality.py (quality per CPU minute)
    return [n for n in ORDER if n in found] + [n for n in found if n not in ORDER]


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH.parent, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=BENCH.parent,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "-"


def bench_path(name: str) -> Path:
    """The file of benchmark `name` ("train" -> bench/bench_train.py; "quality" -> bench/quality.py)."""
    path = BENCH / f"bench_{name}.py"
    return path if path.is_file() else BENCH / f"{name}.py"


def run_one(name: str, argv: list[str] | None, timeout: float = 3600.0) -> dict:
    """Run benchmark `name`'s main(argv) in a child process (`child_main`), its output copied to
    stdout as it comes. Returns {text, result, seconds, error}: error is None, the child's
    traceback, or how it ended ("crashed: SIGSEGV", "exit 2", "timed out after 3600 s")."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-") as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(bench_path(name)),
               "--result-json", str(result_file), "--args", json.dumps(argv or [])]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        text, status = common.run_streaming(cmd, timeout, env=env)
        answer = json.loads(result_file.read_text(encoding="utf-8")) if result_file.is_file() else {}
    error = answer.get("error") or status
    if error and status and status not in error:
        error = f"{status}\n{error}"
    return {"text": text.strip(), "result": answer.get("result"), "seconds": time.perf_counter() - t0,
            "error": error}


def child_main(path: Path, argv: list[str], result_file: Path) -> int:
    """The child process of `run_one`: import the benchmark at `path`, run its main(argv) (main()
    when it takes no arguments), write {"result": ...} or {"error": traceback} to `result_file`
    as JSON. Returns the exit status (0, or 1 after an error)."""
    sys.path.insert(0, str(path.parent))
    try:
        module = importlib.import_module(path.stem)
        main = getattr(module, "main")
        takes_args = len(inspect.signature(main).parameters) > 0
        answer = {"result": main(argv) if takes_args else main()}
    except (Exception, SystemExit) as exc:  # argparse's exit too: one broken benchmark must not hide the others
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            answer = {"result": None}
        else:
            answer = {"error": traceback.format_exc()}
            print(answer["error"], file=sys.stderr, flush=True)
    sys.stdout.flush()
    result_file.write_text(json.dumps(answer, default=str), encoding="utf-8")
    return 1 if "error" in answer else 0


def headlines(runs: dict[str, dict]) -> list[str]:
    """One line per headline figure of the benchmarks this file knows (for the README)."""
    out: list[str] = []
    try:
        _headlines(runs, out)
    except (KeyError, TypeError, IndexError, ZeroDivisionError) as exc:  # never lose the tables over this
        out.append(f"(headlines incomplete: {exc!r})")
    return out


def _headlines(runs: dict[str, dict], out: list[str]) -> None:
    quality = (runs.get("quality") or {}).get("result")
    if quality and quality.get("reference"):
        a, ref = quality["arms"][0], quality["reference"]
        out.append(f"quality: lmforge {a['bits_per_byte']:.3f} held-out bits/byte in {a['train_s']:.0f}s of training "
                   f"vs GPT-2/nanoGPT {ref['bits_per_byte']:.3f} in {ref['train_s']:.0f}s = "
                   f"{a['bits_per_byte'] / ref['bits_per_byte']:.3f}x")
    train = (runs.get("train") or {}).get("result")
    if train:
        for r in train["rows"]:
            out.append(f"training, {r['config']} {r['precision']}: lmforge {r['lmforge']['tokens_per_s']['median']:,.0f} "
                       f"tok/s = {r['ratio']:.2f}x transformers; MFU {100 * r['lmforge']['mfu']:.1f}% of the "
                       f"{r['precision']} matmul peak ({r['matmul_peak_gflops']:,.0f} GFLOP/s)")
    data = (runs.get("data") or {}).get("result")
    if data:
        enc = data["encode_mb_per_s"]
        out.append(f"pretokenizing: lmforge {enc['lmforge']['median']:.2f} MB/s = {data['encode_speedup']:.2f}x HF "
                   f"encode_batch ({enc['HF encode_batch']['median']:.2f} MB/s)")
        out.append(f"data loader: {100 * data['loader']['share']:.2f}% of a speedrun training step")
        rss = data["prepare_rss"]
        if len(rss) > 1:
            out.append(f"prepare peak RSS: {rss[0]['peak_rss_mb']:.0f} MB at {rss[0]['megabytes']:.0f} MB of text, "
                       f"{rss[-1]['peak_rss_mb']:.0f} MB at {rss[-1]['megabytes']:.0f} MB")
    tok = (runs.get("tokenizer") or {}).get("result")
    if tok:
        secs = {k: v["median"] for k, v in tok["seconds"].items()}
        line = f"tokenizer training ({tok['corpus_mb']:.1f} MB, vocab {tok['vocab']}): lmforge " \
               f"{secs['lmforge train_tokenizer']:.1f}s"
        if "sentencepiece BPE" in secs:
            line += f", sentencepiece BPE {secs['sentencepiece BPE']:.1f}s"
        out.append(line)


def record(runs: dict[str, dict], info: dict, config: str, total_s: float, path: Path | None = None) -> None:
    """Append one dated entry (machine, config, each benchmark's tables and JSON) to `path`
    (default bench/RESULTS.md)."""
    path = path or RESULTS
    now = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    lines = [f"## {now}: {info['cpu']}, {info['cores']} cores, torch {info['torch']}", "",
             f"- machine: {common.machine_line(info)}",
             f"- revision: {git_revision()}",
             f"- config: {config}",
             f"- total: {total_s / 60:.1f} min ("
             + ", ".join(f"{n} {r['seconds']:.0f}s" for n, r in runs.items()) + ")", ""]
    heads = headlines(runs)
    if heads:
        lines += ["Headlines:", ""] + [f"- {h}" for h in heads] + [""]
    for name, r in runs.items():
        lines.append(f"### bench_{name}" + (" (FAILED)" if r["error"] else ""))
        lines.append("")
        if r["text"]:
            lines.append(r["text"])
            lines.append("")
        if r["error"]:
            lines += ["```", r["error"].strip()[-3000:], "```", ""]
        if r["result"] is not None:
            blob = json.dumps(r["result"], default=str, sort_keys=True)
            lines += ["<details><summary>raw results (JSON)</summary>", "", "```json", blob, "```", "",
                      "</details>", ""]
    if not path.exists():
        path.write_text("# Benchmark results\n\nAppended by `make bench` (bench/run_all.py); newest last. See "
                        "bench/README.md for what each\nbenchmark measures. Figures from a busy machine are noisy: "
                        "compare entries taken on a quiet one.\n\n", encoding="utf-8")
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmarks; returns {"runs": {name: result}, "failed": [names], "seconds": total}."""
    ap = argparse.ArgumentParser(description="Run the benchmarks in bench/ and record them.")
    ap.add_argument("--only", default="", help="comma-separated names (train, data, tokenizer, masking, decode, "
                                               "quality, gguf, serve, ...)")
    ap.add_argument("--quick", action="store_true", help="shorter runs; not recorded unless --record")
    ap.add_argument("--smoke", action="store_true", help="every benchmark's --smoke: seconds each, proves they run; "
                                                         "never recorded")
    ap.add_argument("--record", action="store_true", help="append to bench/RESULTS.md even with --quick")
    ap.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one benchmark may run before it is "
                                                                  "stopped and reported as failed")
    args = ap.parse_args([] if argv is None else argv)
    if args.smoke and args.record:
        ap.error("--smoke runs are never recorded: drop --record")

    available = discover()
    wanted = [n.strip() for n in args.only.split(",") if n.strip()] or available
    missing = [n for n in wanted if n not in available]
    for n in missing:
        print(f"(bench_{n}.py not found: skipped)", file=sys.stderr)
    names = [n for n in wanted if n in available]
    info = common.machine()
    print(f"# lmforge benchmarks\n\nmachine: {common.machine_line(info)}\n", flush=True)
    t0 = time.perf_counter()
    runs: dict[str, dict] = {}
    for name in names:
        label = bench_path(name).stem
        print(f"\n## {label}\n", flush=True)
        print(f"[{label}] running ...", file=sys.stderr, flush=True)
        bench_args = ["--smoke"] if args.smoke else QUICK_ARGS.get(name) if args.quick else None
        runs[name] = run_one(name, bench_args, args.timeout)
        failure = runs[name]["error"]
        print(f"[{label}] {runs[name]['seconds']:.0f}s"
              + (f" FAILED: {failure.strip().splitlines()[-1]}" if failure else ""), file=sys.stderr, flush=True)
    total = time.perf_counter() - t0
    heads = [] if args.smoke else headlines(runs)
    if heads:
        print("\n## Headlines\n\n" + "\n".join(f"- {h}" for h in heads), flush=True)
    failed = [n for n, r in runs.items() if r["error"]]
    summary = [[bench_path(n).stem, f"{r['seconds']:.0f}",
                "FAILED: " + r["error"].strip().splitlines()[-1] if r["error"] else "ok"] for n, r in runs.items()]
    print("\n" + common.table(["benchmark", "seconds", "status"], summary,
                              title="Summary" + (" (smoke runs)" if args.smoke else "")), flush=True)
    print(f"\nall benchmarks: {total / 60:.1f} min" + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    config = ("smoke" if args.smoke else "quick" if args.quick else "default") + \
        (f", only {','.join(names)}" if args.only else "") + \
        (f"; skipped (not present): {', '.join(missing)}" if missing else "")
    if not args.smoke and (not args.quick or args.record) and not args.no_record:
        record(runs, info, config, total)
        print(f"appended to {RESULTS}", flush=True)
    return {"runs": {n: r["result"] for n, r in runs.items()}, "failed": failed, "seconds": total}


def cli(argv: list[str]) -> int:
    """`python bench/run_all.py ...`: 1 when any benchmark failed, else 0."""
    if argv[:1] == ["--child"]:
        ap = argparse.ArgumentParser()
        ap.add_argument("--child", type=Path, required=True)
        ap.add_argument("--result-json", type=Path, required=True)
        ap.add_argument("--args", default="[]")
        a = ap.parse_args(argv)
        return child_main(a.child, json.loads(a.args), a.result_json)
    return 1 if main(argv)["failed"] else 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
