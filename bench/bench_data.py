"""Data pipeline: pretokenizing throughput, data-loader share of a step, prepare's memory.

1. Encoding throughput (MB of UTF-8 text per second, all cores) on the standard-library
   corpus with the speedrun's 8192-token tokenizer, in batches of `shards.BATCH_DOCS`
   documents as `prepare` feeds them: lmforge's data-path encoder (`fast_encode.batch_encoder`:
   tiktoken from the same merges, ids proven identical by tests/test_fast_encode.py) vs HF
   `tokenizers` `encode_batch` (the reference; `encode_batch_fast`, which skips offsets, is
   shown too). Interleaved; median and min-max over the repeats.
2. `prepare` end to end (read, deduplicate, encode, write shards) with lmforge's encoder and
   with HF `encode_batch` swapped in.
3. Data-loader time as a share of a training step: `RowStream.next_batch` on the prepared
   stdlib shards (packed, document masking) vs `Trainer.train_step` at the speedrun config
   (batch 8 x 256, precision "auto").
4. Peak RSS of a `prepare` process (a fresh subprocess) on a synthetic corpus of 10 MB and
   of 100 MB (stdlib files repeated, each copy with a distinct first line so that none is
   deduplicated): it should stay flat.
5. Issue 33's goal: a `.jsonl.zst` corpus (stdlib slices and random words, `zst_corpus`) of 10 and
   100 MB compressed, prepared by `lmforge prepare`'s code and, side by side on the same file,
   the way users do it today (nanoGPT's prepare.py: `datasets.load_dataset("json").map(encode,
   num_proc=2)`, then a numpy memmap), each in a fresh process with the same tiktoken encoding;
   seconds, MB/s of compressed input and of JSONL, and the peak resident set of the process tree
   (worker processes included). Goals: >= 20 MB/s, peak RSS < 1 GB and growing <= 1.3x for a
   10x corpus; >= 2x faster than the baseline at <= 0.5x its memory.

Run: `python bench/bench_data.py [--repeat 3] [--sizes 10,100] [--corpus-sizes 10,100]
[--only-corpus]`; `--smoke`: seconds, on a
0.2 MB corpus with a 512-token tokenizer and a tiny model (proves the benchmark runs).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

SPEEDUP_GOAL = 2.0
LOADER_GOAL = 0.02


def batched(texts: list[str], n: int) -> list[list[str]]:
    return [texts[i: i + n] for i in range(0, len(texts), n)]


def encode_throughput(tok, texts: list[str], warmup: int, repeat: int) -> dict[str, common.Stats]:
    from lmforge.data.fast_encode import FastEncoder, batch_encoder
    from lmforge.data.prepare import BATCH_DOCS

    fast = batch_encoder(tok)
    if not isinstance(fast, FastEncoder):
        print("  (tiktoken missing or tokenizer unsupported: lmforge encodes with HF tokenizers)", file=sys.stderr)
    batches = batched(texts, BATCH_DOCS)
    hf = tok.hf

    def run(fn):
        return lambda: [fn(b) for b in batches]

    fns = {
        "lmforge": run(fast),
        "HF encode_batch": run(lambda b: [e.ids for e in hf.encode_batch(b, add_special_tokens=False)]),
        "HF encode_batch_fast": run(lambda b: [e.ids for e in hf.encode_batch_fast(b, add_special_tokens=False)]),
    }
    return common.interleaved(fns, warmup, repeat)


def prepare_throughput(tok, workdir: Path, repeat: int, source: str = "stdlib",
                       val_fraction: float = 0.02) -> dict[str, common.Stats]:
    from lmforge.data import prepare as preparing

    original = preparing.batch_encoder

    def run(name: str, encoder_factory):
        def go():
            preparing.batch_encoder = encoder_factory
            try:
                preparing.prepare(source, tok, workdir / name, val_fraction=val_fraction, progress=False)
            finally:
                preparing.batch_encoder = original
        return go

    return common.interleaved({"lmforge": run("lmforge", original),
                               "HF encode_batch": run("hf", lambda t: t.encode_batch)}, 0, repeat)


def loader_share(data_dir: Path, tok, warmup: int, repeat: int, smoke: bool = False) -> dict:
    import bench_train
    from lmforge.data.packing import shard_stream
    from lmforge.data.shards import Shard

    spec = bench_train.SMOKE_CONFIG if smoke else bench_train.CONFIGS["speedrun"]
    shard = Shard.open(data_dir, "train", tok.contract)
    stream = shard_stream(shard, spec["seq_len"], spec["batch"], seed=0, document_masking=True)
    per_call = 10
    with tempfile.TemporaryDirectory() as tmp:
        trainer = bench_train.build_lmforge(spec, "auto", Path(tmp))
        times = common.interleaved({"next_batch x10": lambda: [stream.next_batch() for _ in range(per_call)],
                                    "train_step": trainer.train_step}, warmup, repeat)
    load = common.Stats([t / per_call for t in times["next_batch x10"].samples])
    step = times["train_step"]
    return {"next_batch_s": load.as_dict(), "train_step_s": step.as_dict(),
            "share": load.median / step.median, "precision": trainer.runtime.label,
            "padding_fraction": stream.last_padding_fraction}


def synthetic_corpus(folder: Path, megabytes: float, texts: list[tuple[str, str]]) -> int:
    """Write stdlib files, copy after copy (a distinct first line each), to `megabytes` MB."""
    target, written, copy = int(megabytes * 1_000_000), 0, 0
    while written < target:
        for name, text in texts:
            path = folder / f"copy{copy:03d}" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            data = f"# synthetic copy {copy} of {name}\n{text}".encode("utf-8")
            path.write_bytes(data)
            written += len(data)
            if written >= target:
                break
        copy += 1
    return written


_PREPARE_CHILD = """
import json, resource, sys, time
sys.path.insert(0, {src!r})
from lmforge.data.prepare import prepare
from lmforge.tokenizer import Tokenizer
tok = Tokenizer.load({tok!r})
t0 = time.perf_counter()
meta = prepare({corpus!r}, tok, {out!r}, val_fraction={val_fraction!r}, progress=False)
dt = time.perf_counter() - t0
tokens = sum(m["tokens"] for m in meta["splits"].values())
try:  # this process's own peak (ru_maxrss would include the parent's, inherited at fork)
    hwm = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024
except (OSError, IndexError):
    hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({{"seconds": dt, "tokens": tokens, "peak_rss_mb": hwm}}))
"""


def prepare_rss(tok, sizes: list[float], workdir: Path, val_fraction: float = 0.1) -> list[dict]:
    from lmforge.data.sources import iter_documents

    texts = [(d.name, d.text) for d in iter_documents("stdlib")]
    rows = []
    for mb in sizes:
        corpus = workdir / f"corpus-{mb}mb"
        nbytes = synthetic_corpus(corpus, mb, texts)
        code = _PREPARE_CHILD.format(src=str(common.ROOT / "src"), tok=str(tok.folder), corpus=str(corpus),
                                     out=str(workdir / f"data-{mb}mb"), val_fraction=val_fraction)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"prepare of the {mb} MB corpus failed:\n{res.stderr[-2000:]}")
        out = json.loads(res.stdout.strip().splitlines()[-1])
        out.update(megabytes=nbytes / 1e6, mb_per_s=nbytes / 1e6 / out["seconds"])
        rows.append(out)
        shutil.rmtree(corpus, ignore_errors=True)
        shutil.rmtree(workdir / f"data-{mb}mb", ignore_errors=True)
    return rows


# -- 5. issue 33's goal: a .jsonl.zst corpus, lmforge prepare vs datasets.map + a numpy memmap ------

def zst_corpus(path: Path, megabytes: float, texts: list[str], seed: int = 0) -> dict:
    """A `.jsonl.zst` of `megabytes` MB (compressed), from the standard library and random
    text: each record a random slice (300-6,000 characters) of a stdlib file and a line of 20-100
    random words of it, with its number (so none is a duplicate). Returns its sizes."""
    import random

    import zstandard

    rng = random.Random(seed)
    words = sorted({w for t in texts[:200] for w in t.split() if w.isidentifier()})
    target, n, raw = int(megabytes * 1_000_000), 0, 0
    with open(path, "wb") as f, zstandard.ZstdCompressor(level=3).stream_writer(f, closefd=False) as z:
        while f.tell() < target:
            lines = []
            for _ in range(256):
                t = texts[rng.randrange(len(texts))]
                start = rng.randrange(max(1, len(t) - 300))
                body = t[start: start + rng.randint(300, 6000)]
                line = " ".join(rng.choice(words) for _ in range(rng.randint(20, 100)))
                lines.append(json.dumps({"id": n, "text": f"{body}\n# {n}: {line}\n"}) + "\n")
                n += 1
            data = "".join(lines).encode("utf-8")
            raw += len(data)
            z.write(data)
            z.flush()
    return {"zst_mb": path.stat().st_size / 1e6, "jsonl_mb": raw / 1e6, "records": n}


_NANOGPT_CHILD = """
# The way users prepare a corpus today: nanoGPT's data/openwebtext/prepare.py, with this
# benchmark's tokenizer (the same tiktoken encoding lmforge uses) and 2 processes.
import json, sys, time
sys.path.insert(0, {src!r})
import numpy as np
from datasets import load_dataset, disable_progress_bars
from lmforge.data.fast_encode import batch_encoder
from lmforge.tokenizer import Tokenizer
disable_progress_bars()
tok = Tokenizer.load({tok!r})
enc = batch_encoder(tok).encoding
eot = tok.contract.eos_id
t0 = time.perf_counter()
ds = load_dataset("json", data_files={corpus!r}, split="train", cache_dir={cache!r})
split = ds.train_test_split(test_size=0.02, seed=2357, shuffle=True)
def process(example):
    ids = enc.encode_ordinary(example["text"])
    ids.append(eot)
    return {{"ids": ids, "len": len(ids)}}
tokenized = split.map(process, remove_columns=["text", "id"], num_proc=2)
tokens = 0
for name, dset in tokenized.items():
    arr_len = int(np.sum(dset["len"], dtype=np.uint64))
    arr = np.memmap({out!r} + "-" + name + ".bin", dtype=np.uint16, mode="w+", shape=(arr_len,))
    idx = 0
    n_batches = min(1024, len(dset))
    for b in range(n_batches):
        batch = dset.shard(num_shards=n_batches, index=b, contiguous=True).with_format("numpy")
        arr_batch = np.concatenate(batch["ids"])
        arr[idx: idx + len(arr_batch)] = arr_batch
        idx += len(arr_batch)
    arr.flush()
    tokens += arr_len
print(json.dumps({{"seconds": time.perf_counter() - t0, "tokens": tokens}}))
"""

_LMFORGE_CHILD = """
import json, sys, time
sys.path.insert(0, {src!r})
from lmforge.data.prepare import prepare
from lmforge.data.quality import Quality
from lmforge.tokenizer import Tokenizer
tok = Tokenizer.load({tok!r})
t0 = time.perf_counter()
meta = prepare({corpus!r}, tok, {out!r}, val_fraction=0.02, progress=False, workers={workers},
               quality=Quality(*{quality!r}))
print(json.dumps({{"seconds": time.perf_counter() - t0,
                   "tokens": sum(m["tokens"] for m in meta["splits"].values())}}))
"""


def _process_rss_mb(pid: int) -> list[float]:
    """Resident set of a process and of each of its descendants (MB, one entry a process)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            out.append(int(open(f"/proc/{p}/status").read().split("VmRSS:")[1].split()[0]) / 1024)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            continue
    return out


def run_child(code: str) -> dict:
    """Run `code` in a fresh interpreter; its last line of output (JSON) with the peak resident
    set of its whole process tree (polled every 50 ms: worker processes count too) and of its
    largest process."""
    import threading

    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0.0, 0.0]

    def poll():
        while proc.poll() is None:
            each = _process_rss_mb(proc.pid)
            peak[0] = max(peak[0], sum(each))
            peak[1] = max([peak[1], *each])
            time.sleep(0.05)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    out, err = proc.communicate()
    t.join()
    if proc.returncode != 0:
        raise RuntimeError(f"a benchmark child failed:\n{err[-2000:]}")
    res = json.loads(out.strip().splitlines()[-1])
    res["peak_rss_mb"], res["peak_process_rss_mb"] = peak
    return res


def corpus_goal(tok, sizes: list[float], workdir: Path, texts: list[str], log, baseline: bool = True) -> list[dict]:
    """Section 5: per size (MB of .jsonl.zst) lmforge's prepare and, with `baseline`, nanoGPT's
    way (datasets.map, then a memmap), each in a fresh process; the same corpus file."""
    rows = []
    for mb in sizes:
        corpus = workdir / f"corpus-{mb:g}mb.jsonl.zst"
        info = zst_corpus(corpus, mb, texts)
        arms = {"lmforge prepare": _LMFORGE_CHILD.format(src=str(common.ROOT / "src"), tok=str(tok.folder),
                                                         corpus=str(corpus), out=str(workdir / "lmf-out"), workers=1,
                                                         quality=quality_of("none"))}
        if baseline:
            arms["datasets.map + memmap"] = _NANOGPT_CHILD.format(
                src=str(common.ROOT / "src"), tok=str(tok.folder), corpus=str(corpus),
                cache=str(workdir / "hf-cache"), out=str(workdir / "nano"))
        for name, code in arms.items():
            res = run_child(code)
            res.update(info, arm=name, size_mb=mb)
            res["zst_mb_per_s"] = info["zst_mb"] / res["seconds"]
            res["jsonl_mb_per_s"] = info["jsonl_mb"] / res["seconds"]
            log(f"  {mb:g} MB .jsonl.zst ({info['jsonl_mb']:.0f} MB of JSONL): {name}: {res['seconds']:.1f} s, "
                f"{res['zst_mb_per_s']:.2f} MB/s compressed, {res['jsonl_mb_per_s']:.2f} MB/s of JSONL, peak RSS "
                f"{res['peak_rss_mb']:.0f} MB")
            rows.append(res)
            for leftover in ("lmf-out", "hf-cache"):
                shutil.rmtree(workdir / leftover, ignore_errors=True)
            for f in workdir.glob("nano-*.bin"):
                f.unlink()
        corpus.unlink()
    return rows


def corpus_table(rows: list[dict], smoke: bool) -> str:
    by = {(r["size_mb"], r["arm"]): r for r in rows}
    sizes = sorted({r["size_mb"] for r in rows})
    first = by.get((sizes[0], "lmforge prepare"))
    out = []
    for (mb, arm), r in sorted(by.items()):
        ours = by.get((mb, "lmforge prepare"))
        vs = "" if arm == "lmforge prepare" or ours is None else (
            f"lmforge {r['seconds'] / ours['seconds']:.2f}x faster, {ours['peak_rss_mb'] / r['peak_rss_mb']:.2f}x "
            f"the memory")
        growth = f"{r['peak_rss_mb'] / first['peak_rss_mb']:.2f}x" if arm == "lmforge prepare" else ""
        out.append((f"{mb:g} ({r['jsonl_mb']:.0f} MB JSONL, {r['records']:,} records)", arm, f"{r['seconds']:.1f}",
                    f"{r['zst_mb_per_s']:.2f}", f"{r['jsonl_mb_per_s']:.2f}", f"{r['peak_rss_mb']:.0f}", growth, vs))
    return common.table(
        ["MB .jsonl.zst", "arm", "seconds", "MB/s compressed", "MB/s JSONL", "peak RSS MB (tree)",
         "RSS vs smallest", "vs lmforge"], out,
        title="A .jsonl.zst corpus (stdlib slices + random words): lmforge prepare vs datasets.map + memmap "
              "(nanoGPT's prepare.py), each a fresh process" + (" (SMOKE RUN: figures mean nothing)" if smoke else ""))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warmup", type=int, default=0, help="untimed encoding passes per encoder")
    ap.add_argument("--repeat", type=int, default=3, help="timed encoding passes per encoder")
    ap.add_argument("--prepare-repeat", type=int, default=1, help="timed prepare() runs per encoder")
    ap.add_argument("--sizes", default="10,100", help="synthetic corpus sizes (MB) for the RSS check")
    ap.add_argument("--corpus-sizes", default="10,100",
                    help="sizes (MB, compressed) of the .jsonl.zst corpora of section 5 (issue 33's goal)")
    ap.add_argument("--only-corpus", action="store_true", help="run section 5 only")
    ap.add_argument("--only-workers", action="store_true", help="run section 6 only (data.workers)")
    ap.add_argument("--workers", default="1,2", help="section 6: the data.workers values compared")
    ap.add_argument("--workers-mb", type=float, default=1000, help="section 6: MB of .jsonl.zst")
    ap.add_argument("--workers-rounds", type=int, default=1, help="section 6: alternated rounds")
    ap.add_argument("--quality", default="none", help="section 6: what prepare removes beyond exact duplicates, "
                    "comma-separated: none, minhash, a data.filters name, or several joined by + "
                    "(fineweb_quality+minhash)")
    ap.add_argument("--no-baseline", action="store_true", help="section 5 without the datasets.map arm")
    common.smoke_flag(ap)
    args = ap.parse_args([] if argv is None else argv)
    if args.smoke:
        args.warmup, args.repeat, args.prepare_repeat, args.sizes, args.corpus_sizes = 0, 1, 1, "0.1,0.5", "0.05"
    if args.only_workers:
        return _workers_only(args)
    if args.only_corpus:
        return _corpus_only(args)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok = common.bench_tokenizer(args.smoke, work, 8192, log)
        texts = common.smoke_texts() if args.smoke else common.stdlib_texts()
        source = str(common.smoke_corpus(work / "smoke-corpus")) if args.smoke else "stdlib"
        mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6

        enc = encode_throughput(tok, texts, args.warmup, args.repeat)
        enc_rates = {k: s.rate(mb) for k, s in enc.items()}
        ref = enc_rates["HF encode_batch"].median
        log(f"  encode: lmforge {enc_rates['lmforge'].median:.2f} MB/s, HF encode_batch {ref:.2f} MB/s")

        prep = prepare_throughput(tok, work, args.prepare_repeat, source, 0.2 if args.smoke else 0.02)
        prep_rates = {k: s.rate(mb) for k, s in prep.items()}
        log(f"  prepare: lmforge {prep_rates['lmforge'].median:.2f} MB/s, "
            f"with HF encode_batch {prep_rates['HF encode_batch'].median:.2f} MB/s")
        loader_warmup, loader_repeat = (1, 1) if args.smoke else (2, 5)
        loader = loader_share(work / "lmforge", tok, loader_warmup, loader_repeat, args.smoke)
        log(f"  loader: {1e3 * loader['next_batch_s']['median']:.2f} ms per batch, "
            f"{100 * loader['share']:.2f}% of a step")
        sizes = [float(s) for s in args.sizes.split(",") if s]
        rss = prepare_rss(tok, sizes, work, 0.5 if args.smoke else 0.1)
        log("  prepare RSS: " + ", ".join(f"{r['megabytes']:.1f} MB -> {r['peak_rss_mb']:.0f} MB" for r in rss))
        corpus = corpus_section(args, tok, work, texts)

    enc_rows = []
    for name, s in enc_rates.items():
        ratio = s.median / ref
        enc_rows.append((name, f"{s.median:.2f}", s.spread("{:.2f}"),
                         common.fmt_ratio(ratio, SPEEDUP_GOAL if name == "lmforge" else None)))
    for name, s in prep_rates.items():
        ratio = s.median / prep_rates["HF encode_batch"].median
        label = "prepare(), lmforge" if name == "lmforge" else "prepare(), HF encode_batch swapped in"
        enc_rows.append((label, f"{s.median:.2f}", s.spread("{:.2f}"), common.fmt_ratio(ratio)))
    t1 = common.table(["encoder", "MB/s (median)", "min-max", "vs HF encode_batch"], enc_rows,
                      title=f"Pretokenizing the {'smoke' if args.smoke else 'stdlib'} corpus ({mb:.1f} MB, "
                            f"{len(texts)} documents, vocab {tok.vocab_size})"
                            + (" (SMOKE RUN: figures mean nothing)" if args.smoke else ""))
    ld = loader
    t2 = common.table(
        ["next_batch ms (min-max)", "train_step ms (min-max)", "loader share (goal < 2%)"],
        [(f"{1e3 * ld['next_batch_s']['median']:.2f} ({1e3 * ld['next_batch_s']['min']:.2f}-"
          f"{1e3 * ld['next_batch_s']['max']:.2f})",
          f"{1e3 * ld['train_step_s']['median']:,.0f} ({1e3 * ld['train_step_s']['min']:,.0f}-"
          f"{1e3 * ld['train_step_s']['max']:,.0f})",
          f"{100 * ld['share']:.2f}%" + (" ok" if ld["share"] < LOADER_GOAL else " (over the goal)"))],
        title="Data loader vs a training step (" + ("smoke config, batch 2 x 32, packed smoke shards)" if args.smoke
                                                     else "speedrun config, batch 8 x 256, packed stdlib shards)"))
    base = rss[0]["peak_rss_mb"] if rss else 0.0
    t3 = common.table(
        ["corpus MB", "tokens", "prepare s", "MB/s", "peak RSS MB", "vs smallest"],
        [(f"{r['megabytes']:.1f}", f"{r['tokens']:,}", f"{r['seconds']:.1f}", f"{r['mb_per_s']:.2f}",
          f"{r['peak_rss_mb']:.0f}", f"{r['peak_rss_mb'] / base:.2f}x") for r in rss],
        title="Peak RSS of a prepare process as the corpus grows (synthetic: stdlib repeated)")
    notes = [
        f"encoders run in batches of 64 documents (as prepare does), interleaved, {args.repeat} repeats after "
        f"{args.warmup} warm-up; HF tokenizers and tiktoken both use all {common.cores()} cores.",
        f"loader: {loader['precision']} step; next_batch median over {loader_repeat} rounds of 10 batches; "
        f"padding fraction {100 * loader['padding_fraction']:.1f}%.",
    ]
    t4 = corpus_table(corpus, args.smoke)
    print(t1 + "\n\n" + t2 + "\n\n" + t3 + "\n\n" + t4 + "\n\n" + "\n".join(f"- {n}" for n in notes), flush=True)
    return {"benchmark": "data", "corpus_mb": mb, "documents": len(texts),
            "encode_mb_per_s": {k: s.as_dict() for k, s in enc_rates.items()},
            "prepare_mb_per_s": {k: s.as_dict() for k, s in prep_rates.items()},
            "encode_speedup": enc_rates["lmforge"].median / ref, "loader": loader, "prepare_rss": rss,
            "corpus": corpus,
            "seconds": round(time.perf_counter() - t_start, 1)}


def _section_only(args, name: str, run, table, key: str = "rows") -> dict:
    """One section alone (`--only-workers`, `--only-corpus`): its rows from `run(tok, work, texts, log)`
    with the benchmark's tokenizer and texts, its table printed."""
    t_start = time.perf_counter()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok = common.bench_tokenizer(args.smoke, work, 8192, log)
        texts = common.smoke_texts() if args.smoke else common.stdlib_texts()
        rows = run(tok, work, texts, log)
    print(table(rows, args.smoke), flush=True)
    return {"benchmark": f"data-{name}", key: rows, "cpu": common.cpu_model(),
            "seconds": round(time.perf_counter() - t_start, 1)}


def _workers_only(args) -> dict:
    return _section_only(args, "workers", lambda tok, work, texts, log: workers_section(
        tok, 0.2 if args.smoke else args.workers_mb, [int(x) for x in args.workers.split(",")], args.workers_rounds,
        work, texts, log, tuple(args.quality.split(","))), workers_table)


def _corpus_only(args) -> dict:
    return _section_only(args, "corpus", lambda tok, work, texts, log: corpus_section(args, tok, work, texts),
                         corpus_table, key="corpus")


def quality_of(spec: str) -> tuple[tuple[str, ...], str]:
    """`--quality`'s "none", "minhash", a data.filters name, or several joined by "+": (filters, dedup)."""
    parts = [] if spec == "none" else spec.split("+")
    return tuple(p for p in parts if p != "minhash"), "minhash" if "minhash" in parts else "exact"


def workers_section(tok, mb: float, workers: list[int], rounds: int, workdir: Path, texts: list[str], log,
                    qualities: tuple[str, ...] = ("none",)) -> list[dict]:
    """Section 6 (issue 56): `lmforge prepare`'s code on one `.jsonl.zst` of `mb` MB at each
    `data.workers` (1: one process, no executor; N > 1: lmforge.data.parallel's tasks on
    datatrove's local executor) and each of `qualities` (`quality_of`), each a fresh process, the
    arms alternated for `rounds` rounds; the folders of one quality compared to the byte."""
    import hashlib

    corpus = workdir / f"workers-{mb:g}mb.jsonl.zst"
    info = zst_corpus(corpus, mb, texts)
    rows, digests = [], {}
    for rnd in range(rounds):
        for q, n in ((q, n) for q in qualities for n in workers):
            out = workdir / f"workers-out-{n}"
            res = run_child(_LMFORGE_CHILD.format(src=str(common.ROOT / "src"), tok=str(tok.folder),
                                                  corpus=str(corpus), out=str(out), workers=n, quality=quality_of(q)))
            res.update(info, workers=n, round=rnd, quality=q)
            res["jsonl_mb_per_s"] = info["jsonl_mb"] / res["seconds"]
            digests[q, n] = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(out.iterdir())
                             if f.name != "meta.json"}
            log(f"  round {rnd + 1}, {q}, data.workers = {n}: {res['seconds']:.1f} s, {res['jsonl_mb_per_s']:.2f} MB/s of "
                f"JSONL, peak RSS {res['peak_rss_mb']:.0f} MB (tree), {res['peak_process_rss_mb']:.0f} MB (largest "
                f"process)")
            rows.append(res)
            shutil.rmtree(out)
    corpus.unlink()
    for r in rows:
        r["same_files"] = all(digests[r["quality"], n] == digests[r["quality"], workers[0]] for n in workers)
    return rows


def workers_table(rows: list[dict], smoke: bool) -> str:
    first = min(r["workers"] for r in rows)
    best = {}
    for r in rows:  # each arm's fastest round
        key = (r.get("quality", "none"), r["workers"])
        if key not in best or r["seconds"] < best[key]["seconds"]:
            best[key] = r
    base = best[rows[0].get("quality", "none"), first]
    out = [(q, str(n), f"{r['seconds']:.1f}", f"{r['jsonl_mb_per_s']:.2f}", f"{base['seconds'] / r['seconds']:.2f}x",
            f"{r['peak_rss_mb']:.0f}", f"{r['peak_process_rss_mb']:.0f}", "yes" if r["same_files"] else "NO")
           for (q, n), r in best.items()]
    r0 = rows[0]
    return common.table(
        ["removal (--quality)", "data.workers", "seconds", "MB/s JSONL", "vs the first row", "peak RSS MB (tree)",
         "peak RSS MB (largest process)", "same files"], out,
        title=f"lmforge prepare on {r0['zst_mb']:.0f} MB .jsonl.zst ({r0['jsonl_mb']:.0f} MB JSONL, "
              f"{r0['records']:,} records) by data.workers, best of {max(r['round'] for r in rows) + 1} alternated "
              f"round(s)" + (" (SMOKE RUN: figures mean nothing)" if smoke else ""))


def corpus_section(args, tok, work: Path, texts: list[str]) -> list[dict]:
    import importlib.util

    baseline = importlib.util.find_spec("datasets") is not None and not args.no_baseline
    if not baseline and not args.no_baseline:
        print("  (datasets is not installed: section 5 runs lmforge only)", file=sys.stderr)
    sizes = [float(x) for x in args.corpus_sizes.split(",") if x]
    return corpus_goal(tok, sizes, work, texts, lambda m: print(m, file=sys.stderr, flush=True), baseline)


if __name__ == "__main__":
    main(sys.argv[1:])
