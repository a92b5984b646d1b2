"""Decode throughput of the GGUF export in llama.cpp (f32 and q8_0) next to lmforge's own decode
(eager, and with `generate.compile = true`: the decode step through torch.compile).

A speedrun-sized model (dim 256, 4 layers, 8 query / 4 KV heads, the stdlib tokenizer of
8192 ids, random weights; `--shape smollm2-135m`: a user's SmolLM2-135M shape, `common.SHAPES`, with a
stdlib tokenizer of 49,152 ids; `--shape gemma3-270m`: a user's Gemma 3 270M, saved by transformers with
random weights and imported with `lmforge import-hf`, `common.imported_model`) is saved as an lmforge
checkpoint and exported with
`export_gguf` as f32 and q8_0. Each backend then decodes greedily a fixed number of new
tokens (stopping disabled) from the same prompts (held-out standard-library code, 32
tokens, <|bos|> first), batch 1, interleaved round by round. Reported: median new tokens
per second (prefill included), the ratio to lmforge, and how many leading ids agree with lmforge's
(q8_0 weights are not lmforge's weights: its continuations part ways at some point).

llama.cpp runs through llama-cpp-python (`make interop` installs it), f32 KV cache for
the f32 file and llama.cpp's default f16 KV cache for q8_0; both backends get the same
thread count. Each GGUF file is decoded in a child process of its own (`common.Child`):
llama.cpp's quantized kernels crash on some CPUs (SIGILL, on any quantized GGUF, a
third-party one included), and such a crash is a row of the table ("crashed: SIGILL"), not
the end of the benchmark. The llama.cpp timings include the request to that child (a pipe
round trip, well under a millisecond). Without llama_cpp the llama.cpp rows say
"llama.cpp not installed"; lmforge's decode and the export still run.

    python bench/bench_gguf.py [--new-tokens 64] [--repeats 3] [--threads 1] [--shape smollm2-135m|gemma3-270m]
    python bench/bench_gguf.py --smoke     # seconds, a tiny model and tokenizer: proves it runs
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

from lmforge.runtime import compiler_available  # noqa: E402

GGML_TYPE_F32 = 0
#: (row name, export dtype, f32 KV cache)
BACKENDS = (("llama.cpp f32", "float32", True), ("llama.cpp q8_0", "q8_0", False))
NOT_INSTALLED = "llama.cpp not installed"
N_CTX = 256


#: the row of `generate.compile = true` (lmforge.model.decode.compiled_decode_step)
COMPILED = "lmforge compiled"


def llama_installed() -> bool:
    """Whether llama-cpp-python is importable (found without loading its library)."""
    return importlib.util.find_spec("llama_cpp") is not None


def llama_child_argv(gguf: Path, threads: int, kv_f32: bool) -> list[str]:
    """The command of the child process that decodes `gguf` in llama.cpp (`serve_llama`)."""
    return [sys.executable, str(Path(__file__).resolve()), "--serve-llama", str(gguf), "--threads", str(threads)] \
        + (["--kv-f32"] if kv_f32 else [])


def serve_llama(gguf: str, threads: int, kv_f32: bool) -> None:
    """The child: load `gguf` in llama.cpp, then answer {"prompts": [[id, ...], ...], "new_tokens": n}
    with {"ids": [[n greedy ids], ...]} (one prompt after another, batch 1) until stdin closes."""

    def setup():
        import llama_cpp

        kv = {"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if kv_f32 else {}
        llm = llama_cpp.Llama(model_path=gguf, n_ctx=N_CTX, n_batch=N_CTX, n_threads=threads,
                              n_threads_batch=threads, verbose=False, flash_attn=False, **kv)

        def handle(request: dict) -> dict:
            out = []
            for p in request["prompts"]:
                ids: list[int] = []
                for t in llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
                    ids.append(int(t))
                    if len(ids) == request["new_tokens"]:
                        break
                out.append(ids)
            return {"ids": out}

        return handle

    common.serve_requests(setup)


def build_checkpoint(tmp: Path, tok, smoke: bool = False, shape_name: str = "speedrun"):
    """(checkpoint folder, the model) of random weights: `common.SHAPES[shape_name]` (its vocabulary is
    `tok`'s), or a tiny one in a smoke run."""
    from lmforge.config import load_config
    from lmforge.model import Transformer, resolve_model_config
    from lmforge.train.checkpoint import save_checkpoint

    dims = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2) if smoke else common.SHAPES[shape_name]
    shape = [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in dims.items() if k != "vocab_size"]
    cfg = load_config(None, [f"tokenizer.dir={tok.folder}", *shape, "model.max_seq_len=512",
                             "train.precision=fp32"])
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
    """Run the benchmark, print the table, return {"lmforge": {...}, "llama.cpp f32": {...}, ...}:
    each backend that ran has tok_s median, min, max, vs_lmforge, agree (leading ids equal to
    lmforge's, of `of`), file_mb; one that did not has only `status` ("llama.cpp not installed",
    "crashed: SIGILL", ...)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1,
                    help="threads for both lmforge (torch) and llama.cpp (default 1, as bench_decode)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds a llama.cpp child may take to answer one round before its row says it timed out")
    ap.add_argument("--serve-llama", metavar="GGUF", help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--kv-f32", action="store_true", help=argparse.SUPPRESS)
    common.shape_flag(ap)
    common.smoke_flag(ap)
    args = ap.parse_args([] if argv is None else argv)
    if args.serve_llama:
        serve_llama(args.serve_llama, args.threads, args.kv_f32)
        return {}
    if args.smoke:
        args.new_tokens, args.repeats, args.prompts = 8, 1, 2
    import torch

    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            return _run(args, Path(tmp))
    finally:
        torch.set_num_threads(threads_before)


def _run(args, tmp: Path) -> dict:
    from lmforge.export import export_gguf
    from lmforge.generate import SamplingConfig, generate

    t0 = time.perf_counter()
    if args.shape in common.IMPORTED_SHAPES:  # a transformers folder, imported as the user would
        ckpt, model, tok, _ = common.imported_model(tmp, args.smoke, args.shape)
    else:
        tok = common.bench_tokenizer(args.smoke, tmp, common.SHAPES[args.shape]["vocab_size"])
        ckpt, model = build_checkpoint(tmp, tok, args.smoke, args.shape)
    prompts = prompts_for(tok, args.prompts)
    n_new = args.new_tokens
    sampling = SamplingConfig(max_new_tokens=n_new, greedy=True)
    files = {name: export_gguf(ckpt, tmp / f"model-{dtype}.gguf", dtype=dtype) for name, dtype, _ in BACKENDS}
    sizes = {name: path.stat().st_size for name, path in files.items()}
    last: dict[str, list[list[int]]] = {}

    def lmforge() -> None:
        last["lmforge"] = [generate(model, [p], [], sampling, tok.pad_id)[0] for p in prompts]

    compiled_sampling = replace(sampling, compile=True)

    def lmforge_compiled() -> None:  # generate.compile: the decode step through torch.compile
        last[COMPILED] = [generate(model, [p], [], compiled_sampling, tok.pad_id)[0] for p in prompts]

    def llama(name: str, child: common.Child):
        def fn() -> None:
            last[name] = child.request({"prompts": prompts, "new_tokens": n_new})["ids"]
        return fn

    fns = {"lmforge": lmforge}
    status: dict[str, str] = {}  # backends with no figures: why
    if args.smoke:
        status[COMPILED] = "not run in --smoke (its compile takes ~30 s)"
    elif not compiler_available(torch.device("cpu")):
        status[COMPILED] = "no C++ compiler"
    else:
        fns[COMPILED] = lmforge_compiled
    children: dict[str, common.Child] = {}
    installed = llama_installed()
    for name, _, kv_f32 in BACKENDS:
        if not installed:
            status[name] = NOT_INSTALLED
            continue
        children[name] = common.Child(llama_child_argv(files[name], args.threads, kv_f32), timeout=args.timeout)
        fns[name] = llama(name, children[name])
    try:
        times = common.interleaved(fns, 1, args.repeats, failed=status)
    finally:
        for child in children.values():
            child.close()

    work = n_new * len(prompts)
    base = times["lmforge"].median
    results: dict = {}
    for name in fns.keys() | status.keys():
        if name in status:
            results[name] = {"status": status[name]}
            continue
        s = times[name].rate(work)
        agree = sum(_common_prefix(x, y) for x, y in zip(last[name], last["lmforge"]))
        results[name] = {"tok_s": s.median, "min": s.min, "max": s.max, "vs_lmforge": base / times[name].median,
                         "agree": agree, "of": work, "file_mb": sizes.get(name, 0) / 2**20}
    results.update(new_tokens=n_new, prompts=len(prompts), repeats=args.repeats, threads=args.threads,
                   llama_cpp_installed=installed, smoke=args.smoke, seconds=time.perf_counter() - t0)
    c = model.config
    print(f"gguf: greedy decode, batch 1, {len(prompts)} prompts of 32 tokens, {n_new} new tokens each (no "
          f"stopping), dim {c.dim} / {c.n_layers} layers / {c.n_heads}+{c.n_kv_heads} heads / vocab "
          f"{tok.vocab_size}, {args.threads} thread(s), median of {args.repeats}; tokens/s = new tokens / wall "
          f"time, prefill included" + (" (SMOKE RUN: figures mean nothing)" if args.smoke else ""))
    rows = []
    for name in ["lmforge", COMPILED, *(b[0] for b in BACKENDS)]:
        r = results[name]
        size = f"{sizes[name] / 2**20:.1f}" if name in sizes else "-"
        if "status" in r:
            rows.append([name, r["status"], "-", "-", "-", size])
        else:
            rows.append([name, f"{r['tok_s']:.1f}", f"{r['min']:.1f}-{r['max']:.1f}", f"{r['vs_lmforge']:.2f}x",
                         f"{r['agree']}/{r['of']}", size])
    print(common.table(["backend", "tok/s", "min-max", "vs lmforge", "same ids as lmforge (leading)", "GGUF MiB"],
                       rows))
    for name, child in children.items():
        if child.failed is not None and child.failed.detail:
            print(f"- {name}: {child.failed.status}; the end of its stderr:\n\n```\n{child.failed.detail}\n```")
    print(f"({results['seconds']:.0f} s in all)")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
