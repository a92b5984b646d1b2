"""Decode throughput of the GGUF export in llama.cpp (f32 and q8_0) next to lmforge's own decode.

A speedrun-sized model (dim 256, 4 layers, 8 query / 4 KV heads, the stdlib tokenizer of
8192 ids, random weights) is saved as an lmforge checkpoint and exported with
`export_gguf` as f32 and q8_0. Each backend then decodes greedily a fixed number of new
tokens (stopping disabled) from the same prompts (held-out standard-library code, 32
tokens, <|bos|> first), batch 1, interleaved round by round. Reported: median new tokens
per second (prefill included), the ratio to lmforge, and how many leading ids agree with lmforge's
(q8_0 weights are not lmforge's weights: its continuations part ways at some point).

llama.cpp runs through llama-cpp-python (`make interop` installs it), f32 KV cache for
the f32 file and llama.cpp's default f16 KV cache for q8_0; both backends get the same
thread count. Skips with a message when llama_cpp is not installed.

    python bench/bench_gguf.py [--new-tokens 64] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import common  # noqa: E402
from lmforge.config import load_config  # noqa: E402
from lmforge.export import export_gguf  # noqa: E402
from lmforge.generate import SamplingConfig, generate  # noqa: E402
from lmforge.model import Transformer, resolve_model_config  # noqa: E402
from lmforge.train.checkpoint import save_checkpoint  # noqa: E402

GGML_TYPE_F32 = 0


def build_checkpoint(tmp: Path, tok) -> tuple[Path, Transformer]:
    cfg = load_config(None, [f"tokenizer.dir={tok.folder}", "model.dim=256", "model.n_layers=4", "model.n_heads=8",
                             "model.n_kv_heads=4", "model.max_seq_len=512", "train.precision=fp32"])
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    model.reset_parameters(seed=0)
    return save_checkpoint(tmp / "run", 0, model, cfg, tok.folder), model.eval()


def prompts_for(tok, n: int, length: int = 32) -> list[list[int]]:
    texts = common.stdlib_texts("val")
    out = []
    for t in texts[:: max(1, len(texts) // n)][:n]:
        out.append([tok.bos_id, *tok.encode(t)[: length - 1]])
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Leading ids two greedy continuations share (after the first difference they decode from
    different contexts, so later matches mean nothing)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the table, return {"lmforge": {...}, "llama.cpp f32": {...}, ...}
    (each: tok_s median, min, max; agree = leading ids equal to lmforge's, of `of`), or {"skipped": why}."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1,
                    help="threads for both lmforge (torch) and llama.cpp (default 1, as bench_decode)")
    args = ap.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        msg = "llama_cpp is not installed (run `make interop` to build it); bench_gguf skipped"
        print(msg)
        return {"skipped": msg}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            return _run(args, Path(tmp), llama_cpp)
    finally:
        torch.set_num_threads(threads_before)


def _run(args, tmp: Path, llama_cpp) -> dict:
    t0 = time.perf_counter()
    tok, _ = common.stdlib_tokenizer(8192)
    ckpt, model = build_checkpoint(tmp, tok)
    prompts = prompts_for(tok, args.prompts)
    n_new = args.new_tokens
    sampling = SamplingConfig(max_new_tokens=n_new, greedy=True)

    def llama(dtype: str, kv_f32: bool):
        path = export_gguf(ckpt, tmp / f"model-{dtype}.gguf", dtype=dtype)
        kv = {"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if kv_f32 else {}
        return llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=256, n_threads=args.threads,
                               n_threads_batch=args.threads, verbose=False, flash_attn=False, **kv), path

    runners = {"lmforge": None}
    sizes = {}
    for name, dtype, kv in (("llama.cpp f32", "float32", True), ("llama.cpp q8_0", "q8_0", False)):
        runners[name], path = llama(dtype, kv)
        sizes[name] = path.stat().st_size

    def run(name: str) -> list[list[int]]:
        if name == "lmforge":
            return [generate(model, [p], [], sampling, tok.pad_id)[0] for p in prompts]
        llm = runners[name]
        out = []
        for p in prompts:
            ids = []
            for t in llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
                ids.append(t)
                if len(ids) == n_new:
                    break
            out.append(ids)
        return out

    names = list(runners)
    results: dict = {}
    last: dict = {}
    times: dict = {n: [] for n in names}
    for n in names:
        last[n] = run(n)  # warm-up
    for r in range(args.repeats):
        for n in names if r % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            last[n] = run(n)
            times[n].append(time.perf_counter() - t)
    work = n_new * len(prompts)
    base = statistics.median(times["lmforge"])
    for n in names:
        s = common.Stats(times[n]).rate(work)
        agree = sum(_common_prefix(x, y) for x, y in zip(last[n], last["lmforge"]))
        results[n] = {"tok_s": s.median, "min": s.min, "max": s.max, "vs_lmforge": base / statistics.median(times[n]),
                      "agree": agree, "of": work, "file_mb": sizes.get(n, 0) / 2**20}
    results.update(new_tokens=n_new, prompts=len(prompts), repeats=args.repeats, threads=args.threads,
                   seconds=time.perf_counter() - t0)
    print(f"gguf: greedy decode, batch 1, {len(prompts)} prompts of 32 tokens, {n_new} new tokens each (no "
          f"stopping), dim 256 / 4 layers / 8+4 heads / vocab {tok.vocab_size}, {args.threads} thread(s), "
          f"median of {args.repeats}; tokens/s = new tokens / wall time, prefill included")
    rows = [[n, f"{r['tok_s']:.1f}", f"{r['min']:.1f}-{r['max']:.1f}", f"{r['vs_lmforge']:.2f}x",
             f"{r['agree']}/{r['of']}", f"{r['file_mb']:.1f}" if r["file_mb"] else "-"]
            for n, r in ((n, results[n]) for n in names)]
    print(common.table(["backend", "tok/s", "min-max", "vs lmforge", "same ids as lmforge (leading)", "GGUF MiB"], rows))
    print(f"({results['seconds']:.0f} s in all)")
    return results


if __name__ == "__main__":
    main()
