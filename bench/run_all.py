"""Run every benchmark in bench/ (`make bench`), print their tables, and append them to
bench/RESULTS.md with the date, the machine and the configuration.

Each `bench/bench_*.py` module exposes `main()` that prints its table(s) and returns a
dict; modules that are missing are skipped, and one that fails is reported and does not
stop the others. Known benchmarks run in a fixed order (train, data, tokenizer, masking,
decode), then any other bench_*.py in name order.

Usage:
    python bench/run_all.py                  # everything, recorded in bench/RESULTS.md
    python bench/run_all.py --only train,data
    python bench/run_all.py --quick          # shorter runs of train/data/tokenizer; not recorded
    python bench/run_all.py --no-record      # print only
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib
import inspect
import io
import json
import subprocess
import sys
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


class Tee(io.TextIOBase):
    """Write to the real stream and keep a copy."""

    def __init__(self, stream):
        self.stream, self.buffer = stream, io.StringIO()

    def write(self, s: str) -> int:
        self.stream.write(s)
        self.buffer.write(s)
        return len(s)

    def flush(self) -> None:
        self.stream.flush()


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


def run_one(name: str, argv: list[str] | None) -> dict:
    """Import bench_<name> and run its main(); returns {text, result, seconds, error}."""
    t0 = time.perf_counter()
    tee = Tee(sys.stdout)
    result, error = None, None
    try:
        module = importlib.import_module(f"bench_{name}" if (BENCH / f"bench_{name}.py").is_file() else name)
        main = getattr(module, "main")
        takes_args = len(inspect.signature(main).parameters) > 0
        with contextlib.redirect_stdout(tee):
            result = main(argv or []) if takes_args else main()
    except Exception:  # one broken benchmark must not hide the others
        error = traceback.format_exc()
        print(error, file=sys.stderr)
    return {"text": tee.buffer.getvalue().strip(), "result": result, "seconds": time.perf_counter() - t0,
            "error": error}


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
    ap = argparse.ArgumentParser(description="Run the benchmarks in bench/ and record them.")
    ap.add_argument("--only", default="", help="comma-separated names (train, data, tokenizer, masking, decode)")
    ap.add_argument("--quick", action="store_true", help="shorter runs; not recorded unless --record")
    ap.add_argument("--record", action="store_true", help="append to bench/RESULTS.md even with --quick")
    ap.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    args = ap.parse_args(argv)

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
        print(f"\n## bench_{name}\n", flush=True)
        print(f"[bench_{name}] running ...", file=sys.stderr, flush=True)
        runs[name] = run_one(name, QUICK_ARGS.get(name) if args.quick else None)
        print(f"[bench_{name}] {runs[name]['seconds']:.0f}s" + (" FAILED" if runs[name]["error"] else ""),
              file=sys.stderr, flush=True)
    total = time.perf_counter() - t0
    heads = headlines(runs)
    if heads:
        print("\n## Headlines\n\n" + "\n".join(f"- {h}" for h in heads), flush=True)
    print(f"\nall benchmarks: {total / 60:.1f} min", flush=True)
    config = ("quick" if args.quick else "default") + (f", only {','.join(names)}" if args.only else "") + \
        (f"; skipped (not present): {', '.join(missing)}" if missing else "")
    if (not args.quick or args.record) and not args.no_record:
        record(runs, info, config, total)
        print(f"appended to {RESULTS}", flush=True)
    failed = [n for n, r in runs.items() if r["error"]]
    return {"runs": {n: r["result"] for n, r in runs.items()}, "failed": failed, "seconds": total}


if __name__ == "__main__":
    out = main(sys.argv[1:])
    sys.exit(1 if out["failed"] else 0)
