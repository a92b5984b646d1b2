"""The decoding policy, measured: greedy decode of the speedrun-shaped model (dim 256, 4 layers,
vocab 8,192; random weights, 1 thread) in fp32 and under bf16 autocast, side by side in one
process (3 alternating repeats, best of each), at batch 1 and batch 8, 64 new tokens.

    python bench/bench_decode_policy.py

Prints tokens/s for both, the ratio, and how many greedy ids agree. `lmforge.runtime.
decode_runtime` (fp32 on a CPU) is chosen from this table.
"""

from __future__ import annotations

import time

import torch

from lmforge.config import ModelConfig, SamplingConfig
from lmforge.generate import generate
from lmforge.model import Transformer


def main() -> None:
    torch.set_num_threads(1)
    model = Transformer(ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192,
                                    max_seq_len=512)).eval()
    model.reset_parameters(seed=0)
    decode = generate.__wrapped__  # without the policy: each precision explicitly
    cfg = SamplingConfig(max_new_tokens=64, greedy=True)
    print("| batch | fp32 tokens/s | bf16 autocast tokens/s | fp32 / bf16 | greedy ids equal |")
    print("|---|---|---|---|---|")
    for batch in (1, 8):
        prompts = [[1] + [(7 * i + 13 * b) % 8000 + 5 for i in range(32)] for b in range(batch)]
        best, ids = {}, {}
        for _ in range(3):
            for name, ctx in (("fp32", torch.autocast("cpu", enabled=False)),
                              ("bf16", torch.autocast("cpu", dtype=torch.bfloat16))):
                with ctx:
                    t0 = time.perf_counter()
                    ids[name] = decode(model, prompts, [], cfg, 0)
                    rate = batch * cfg.max_new_tokens / (time.perf_counter() - t0)
                best[name] = max(best.get(name, 0.0), rate)
        same = sum(a == b for r1, r2 in zip(ids["fp32"], ids["bf16"]) for a, b in zip(r1, r2))
        print(f"| {batch} | {best['fp32']:,.0f} | {best['bf16']:,.0f} | {best['fp32'] / best['bf16']:.2f}x | "
              f"{same}/{batch * cfg.max_new_tokens} |")


if __name__ == "__main__":
    main()
