"""Decode throughput: lmforge `generate` against `transformers`' `generate`, same weights, this CPU.

A speedrun-sized model (dim 256, 4 layers, 8 query / 4 KV heads, vocab 8192, random
weights) is built in lmforge, converted with the exporter's own `to_hf_state` /
`hf_config` into a `LlamaForCausalLM`, and both generate greedily a fixed number of new
tokens (stopping disabled) from the same prompts, batch 1 and batch 8. Reported:
median new tokens per second over a few repeats (prefill included), the ratio, and
whether both produced the same ids.

    python bench/bench_decode.py [--new-tokens 64] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract, token_dtype_for
from lmforge.export import hf_config, require_transformers, to_hf_state
from lmforge.generate import SamplingConfig, generate
from lmforge.model import Transformer
from lmforge.model.io import model_state

VOCAB = 8192
PAD, BOS, EOS, IM_START, IM_END = 0, 1, 2, 3, 4  # a synthetic contract for random weights


def build_models(seed: int = 0, max_seq_len: int = 512):
    """(lmforge model, HF LlamaForCausalLM) with identical float32 weights."""
    transformers = require_transformers()
    cfg = ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=VOCAB, max_seq_len=max_seq_len)
    ours = Transformer(cfg)
    ours.reset_parameters(seed=seed)
    contract = Contract("", VOCAB, VOCAB, {"pad": PAD, "bos": BOS, "eos": EOS, "im_start": IM_START,
                                           "im_end": IM_END}, "", token_dtype_for(VOCAB))
    hf_cfg = {k: v for k, v in hf_config(cfg, contract).items() if k not in ("architectures", "model_type", "torch_dtype")}
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg))
    theirs.load_state_dict(to_hf_state(model_state(ours), VOCAB, cfg.tie_embeddings), strict=True)
    return ours.eval(), theirs.float().eval()


def prompts_for(batch: int, seed: int) -> list[list[int]]:
    """`batch` prompts of 16..32 tokens (different lengths: left padding is exercised)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [32 - (i * 5) % 17 for i in range(batch)]
    return [[BOS, *torch.randint(5, VOCAB, (n - 1,), generator=g).tolist()] for n in lengths]


def run_lmforge(model, prompts, n_new: int) -> list[list[int]]:
    return generate(model, prompts, [], SamplingConfig(max_new_tokens=n_new, greedy=True), PAD)


def run_hf(model, prompts, n_new: int) -> list[list[int]]:
    transformers = require_transformers()
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    gc = transformers.GenerationConfig(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                       eos_token_id=None, pad_token_id=PAD, bos_token_id=BOS)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
    return out[:, L:].tolist()


def timed_pair(fa, fb, repeats: int) -> tuple[dict, dict, list, list]:
    """Run `fa` and `fb` alternately (one warm-up each, then `repeats` times) so load changes on a
    shared machine hit both alike. Returns per function {"wall": median s, "cpu": median
    process CPU s} and the last results."""
    fa(), fb()  # warm-up
    times: dict = {"a": {"wall": [], "cpu": []}, "b": {"wall": [], "cpu": []}}
    ra = rb = None
    for _ in range(repeats):
        for key, fn in (("a", fa), ("b", fb)):
            w, c = time.perf_counter(), time.process_time()
            r = fn()
            times[key]["wall"].append(time.perf_counter() - w)
            times[key]["cpu"].append(time.process_time() - c)
            if key == "a":
                ra = r
            else:
                rb = r
    med = {k: {m: statistics.median(v) for m, v in t.items()} for k, t in times.items()}
    return med["a"], med["b"], ra, rb


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the table, return {"batch_1": {...}, "batch_8": {...}, ...}.

    Each batch entry: lmforge_tok_s, transformers_tok_s (wall clock), ratio (wall),
    cpu_ratio (process CPU time: steadier on a shared machine), same_ids.
    """
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for both (default 1: several threads on a busy 2-core "
                         "machine spend most of their time waiting for each other)")
    args = ap.parse_args(argv)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads_before)  # run_all.py runs other benchmarks in this process


def _run(args) -> dict:
    torch.manual_seed(0)
    t0 = time.perf_counter()
    ours, theirs = build_models()
    results: dict = {"threads": torch.get_num_threads(), "new_tokens": args.new_tokens, "repeats": args.repeats}
    for batch in args.batches:
        prompts = prompts_for(batch, seed=batch)
        a, b, ids_ours, ids_hf = timed_pair(lambda: run_lmforge(ours, prompts, args.new_tokens),
                                            lambda: run_hf(theirs, prompts, args.new_tokens), args.repeats)
        n = batch * args.new_tokens
        results[f"batch_{batch}"] = {
            "lmforge_tok_s": n / a["wall"], "transformers_tok_s": n / b["wall"], "ratio": b["wall"] / a["wall"],
            "cpu_ratio": b["cpu"] / a["cpu"], "same_ids": ids_ours == ids_hf,
        }
    results["seconds"] = time.perf_counter() - t0
    print(f"decode: greedy, {args.new_tokens} new tokens (no stopping), prompts of 16-32 tokens left-padded, "
          f"dim 256 / 4 layers / 8+4 heads / vocab 8192, fp32, {results['threads']} thread(s), "
          f"median of {args.repeats}; tokens/s = new tokens / wall time, prefill included")
    print(f"{'batch':>5} | {'lmforge tok/s':>13} | {'transformers tok/s':>18} | {'ratio':>6} | "
          f"{'CPU-time ratio':>14} | same ids")
    print("-" * 81)
    for batch in args.batches:
        r = results[f"batch_{batch}"]
        print(f"{batch:>5} | {r['lmforge_tok_s']:>13.1f} | {r['transformers_tok_s']:>18.1f} | "
              f"{r['ratio']:>5.2f}x | {r['cpu_ratio']:>13.2f}x | {r['same_ids']}")
    print(f"({results['seconds']:.0f} s in all)")
    return results


if __name__ == "__main__":
    main()
