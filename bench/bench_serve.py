"""Served decoding: `lmforge serve` under 1, 4 and 16 concurrent clients, next to `generate`
on the same batch sizes, this CPU.

A speedrun-sized model (dim 256, 4 layers, 8 query / 4 KV heads, the 8192-token stdlib
tokenizer, random weights) is saved as a checkpoint and served by the real command
(`python -m lmforge serve --port 0`, in its own process, torch on `--threads` threads).
Each of C clients (threads here) sends `--requests` streamed `/v1/completions` one after
another (greedy, `--max-tokens` new tokens, prompts: the first lines of stdlib modules).
Reported per C: served tokens/s (completion tokens from `usage` / wall time of the
level), time to first token p50 / p95 (request sent -> first text chunk), and `generate`
in this process with the same number of prompts in one batch (tokens/s, and its time to
the first token = a 1-token generate). Clients and server share the machine's cores.

    python bench/bench_serve.py [--clients 1 4 16] [--requests 3] [--max-tokens 64] [--threads 1]
    python bench/bench_serve.py --smoke     # seconds, a tiny model and tokenizer: proves it runs
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (puts src/ on sys.path)
import torch  # noqa: E402

from lmforge.config import load_config  # noqa: E402
from lmforge.generate import SamplingConfig, generate  # noqa: E402
from lmforge.model import Transformer, resolve_model_config  # noqa: E402
from lmforge.train.checkpoint import save_checkpoint  # noqa: E402


def prompts(n: int) -> list[str]:
    """n different prompts: the first non-empty, non-comment line of stdlib modules."""
    out = []
    for text in common.stdlib_texts("val"):
        for line in text.splitlines():
            if line.strip() and not line.lstrip().startswith(("#", '"', "'")):
                out.append(line[:80])
                break
        if len(out) == n:
            return out
    return (out * n)[:n]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def stream_one(port: int, prompt: str, max_tokens: int) -> tuple[float, int, float]:
    """(time to first text s, completion tokens, total s) of one streamed completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    ttft, tokens = None, 0
    for raw in resp:  # bounded: the server ends the stream with [DONE] after max_tokens at most
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            tokens = ev["usage"]["completion_tokens"]
        if ttft is None and ev.get("choices") and ev["choices"][0]["text"]:
            ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    conn.close()
    return (ttft if ttft is not None else total), tokens, total


def start_server(ckpt: Path, threads: int) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(common.ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "lmforge", "serve", "--checkpoint", str(ckpt), "--port", "0"],
                            env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    port = None
    while port is None and time.monotonic() < deadline:  # bounded: 3 minutes to load and listen
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"lmforge serve exited with {proc.returncode}")
        m = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        if m:
            port = int(m.group(1))
    if port is None:
        proc.kill()
        raise RuntimeError("lmforge serve did not start within 180 s")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining its stderr
    for _ in range(100):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                break
        except OSError:
            time.sleep(0.1)
    return proc, port


def run_level(port: int, n_clients: int, requests: int, max_tokens: int, texts: list[str]) -> dict:
    ttfts, tokens, errors = [], [0], []
    lock = threading.Lock()

    def client(i: int) -> None:
        for r in range(requests):
            try:
                ttft, n, _ = stream_one(port, texts[(i * requests + r) % len(texts)], max_tokens)
            except Exception as exc:  # noqa: BLE001 (reported, not fatal)
                errors.append(repr(exc))
                continue
            with lock:
                ttfts.append(ttft)
                tokens[0] += n

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    wall = time.perf_counter() - t0
    return {"clients": n_clients, "requests": len(ttfts), "tokens": tokens[0], "wall_s": wall,
            "tok_s": tokens[0] / wall, "ttft_p50_s": statistics.median(ttfts) if ttfts else float("nan"),
            "ttft_p95_s": percentile(ttfts, 0.95) if ttfts else float("nan"), "errors": errors[:3]}


def time_generate(model, tok, texts: list[str], batch: int, max_tokens: int, repeats: int = 3) -> dict:
    rows = [[tok.bos_id, *tok.encode(t)] for t in texts[:batch]]
    rows = (rows * batch)[:batch]
    full = SamplingConfig(max_new_tokens=max_tokens, greedy=True)
    one = SamplingConfig(max_new_tokens=1, greedy=True)
    generate(model, rows, [], full, tok.pad_id)  # warm-up
    walls, firsts = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        generate(model, rows, [], one, tok.pad_id)
        firsts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        generate(model, rows, [], full, tok.pad_id)
        walls.append(time.perf_counter() - t0)
    return {"tok_s": batch * max_tokens / statistics.median(walls), "ttft_s": statistics.median(firsts)}


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the table, return {"levels": [...], ...}."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=3, help="streamed requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, for the server and for generate")
    common.smoke_flag(ap)
    args = ap.parse_args([] if argv is None else argv)
    if args.smoke:
        args.clients, args.requests, args.max_tokens = [1, 2], 1, 4
    t_start = time.perf_counter()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    results: dict = {"threads": args.threads, "max_tokens": args.max_tokens, "requests_per_client": args.requests,
                     "levels": [], "smoke": args.smoke}
    with tempfile.TemporaryDirectory() as tmp:
        tok = common.bench_tokenizer(args.smoke, Path(tmp), 8192)
        shape = (["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2"] if args.smoke else
                 ["model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4"])
        cfg = load_config(None, [*shape, "model.max_seq_len=512", f"tokenizer.dir={tok.folder}"])
        model = Transformer(resolve_model_config(cfg.model, tok.contract))
        model.reset_parameters(seed=0)
        model.eval()
        texts = prompts(64)
        ckpt = save_checkpoint(Path(tmp) / "run", 1, model, cfg, tok.folder)
        proc, port = start_server(ckpt, args.threads)
        try:
            stream_one(port, texts[0], 8)  # warm-up
            for c in args.clients:
                level = run_level(port, c, args.requests, args.max_tokens, texts)
                level["generate"] = time_generate(model, tok, texts, c, args.max_tokens)
                results["levels"].append(level)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    torch.set_num_threads(threads_before)
    results["seconds"] = time.perf_counter() - t_start
    c = model.config
    print(f"serve: streamed /v1/completions, greedy, up to {args.max_tokens} new tokens, {args.requests} requests "
          f"per client one after another; dim {c.dim} / {c.n_layers} layers / vocab {tok.vocab_size}, fp32, "
          f"{args.threads} torch thread(s); generate: the same number of prompts in one batch, {args.max_tokens} "
          f"new tokens" + (" (SMOKE RUN: figures mean nothing)" if args.smoke else ""))
    rows = []
    for lv in results["levels"]:
        g = lv["generate"]
        rows.append([lv["clients"], f"{lv['tok_s']:.1f}", f"{lv['ttft_p50_s']:.3f}", f"{lv['ttft_p95_s']:.3f}",
                     f"{g['tok_s']:.1f}", f"{g['ttft_s']:.3f}",
                     str(lv["requests"]) + (f" (errors: {lv['errors']})" if lv["errors"] else "")])
    print(common.table(["clients", "served tok/s", "TTFT p50 s", "TTFT p95 s", "generate tok/s", "generate TTFT s",
                        "requests"], rows))
    print(f"({results['seconds']:.0f} s in all)")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
