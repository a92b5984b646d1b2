"""The decoding policy, measured: greedy decode of the speedrun-shaped model (dim 256, 4 layers,
vocab 8,192; random weights, 1 thread) in fp32 and under bf16 autocast, side by side in one
process (3 alternating repeats, best of each), at batch 1 and batch 8, 64 new tokens.

    python bench/bench_decode_policy.py
    python bench/bench_decode_policy.py --smoke     # seconds, a tiny model: proves it runs

Prints tokens/s for both, the ratio, and how many greedy ids agree. `lmforge.runtime.
decode_runtime` (fp32 on a CPU) is chosen from this table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import common  # noqa: E402
from lmforge.config import ModelConfig, SamplingConfig  # noqa: E402
from lmforge.generate import generate  # noqa: E402
from lmforge.model import Transformer  # noqa: E402
from lmforge.runtime import Runtime  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    """Print the table; return {"batch_1": {"fp32_tok_s", "bf16_tok_s", "same_ids", "of"}, ...}."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    common.smoke_flag(ap)
    args = ap.parse_args([] if argv is None else argv)
    shape = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512) if args.smoke else \
        dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192)
    new_tokens, batches, repeats = (8, (1, 3), 1) if args.smoke else (64, (1, 8), args.repeats)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    model = Transformer(ModelConfig(**shape, max_seq_len=512)).eval()
    model.reset_parameters(seed=0)
    cfg = SamplingConfig(max_new_tokens=new_tokens, greedy=True)
    vocab = shape["vocab_size"]
    contract = common.synthetic_contract(vocab)  # random weights: a synthetic pad/bos
    rows, results = [], {}
    for batch in batches:
        prompts = [[contract.bos_id] + [(7 * i + 13 * b) % (vocab - 192) + 5 for i in range(32)] for b in range(batch)]
        best, ids = {}, {}
        for _ in range(repeats):
            for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):  # each precision explicitly
                t0 = time.perf_counter()
                runtime = Runtime(torch.device("cpu"), dtype)
                ids[name] = generate(model, prompts, [], cfg, contract.pad_id, runtime=runtime)
                rate = batch * cfg.max_new_tokens / (time.perf_counter() - t0)
                best[name] = max(best.get(name, 0.0), rate)
        same = sum(a == b for r1, r2 in zip(ids["fp32"], ids["bf16"]) for a, b in zip(r1, r2))
        results[f"batch_{batch}"] = {"fp32_tok_s": best["fp32"], "bf16_tok_s": best["bf16"], "same_ids": same,
                                     "of": batch * cfg.max_new_tokens}
        rows.append([batch, f"{best['fp32']:,.0f}", f"{best['bf16']:,.0f}", f"{best['fp32'] / best['bf16']:.2f}x",
                     f"{same}/{batch * cfg.max_new_tokens}"])
    torch.set_num_threads(threads_before)
    print(common.table(["batch", "fp32 tokens/s", "bf16 autocast tokens/s", "fp32 / bf16", "greedy ids equal"], rows,
                       title=f"Greedy decode, fp32 vs bf16 autocast (dim {shape['dim']}, {shape['n_layers']} layers, "
                             f"vocab {vocab}, {new_tokens} new tokens, best of {repeats})"
                             + (" (SMOKE RUN: figures mean nothing)" if args.smoke else "")))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
