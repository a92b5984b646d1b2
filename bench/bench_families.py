"""A Gemma 3 270M-class training step: lmforge against transformers, time and peak memory.

Both sides build the real Gemma 3 270M shape from transformers' own `Gemma3TextConfig` (hidden
640, 18 layers, 4 query / 1 KV heads of 256, MLP 2,048, vocabulary 262,144, window 512, pattern
5 sliding : 1 full; random weights, nothing downloaded): transformers' `Gemma3ForCausalLM`, and
lmforge's model from the same config.json through `lmforge.export.hf_in.model_config_from_hf`.
A step is an SFT step's work: forward on B x T tokens with labels, the loss, backward (no
optimizer: its cost does not depend on the framework). Precision: bf16 autocast where the CPU
has bf16 units (`lmforge.runtime`), else float32, the same on both sides; transformers runs its
sdpa attention (its default) and computes the loss from full float32 logits, lmforge its fused
loss (never B x T x V logits).

Each side runs in a process of its own (`--side`), so peak memory is its own: resident memory
sampled every 2 ms during the steps, minus the resident memory before them (weights and
gradients' first allocation excluded by a warm-up step). Times are the median of `--repeat` steps
after `--warmup`. The table prints both and the ratios.

Run: `python bench/bench_families.py [--batch 2] [--seq-len 256] [--repeat 3]`;
`--smoke`: a tiny Gemma 3 of the same layout, seconds (proves the benchmark runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

GEMMA3_270M = dict(vocab_size=262_144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                   sliding_window=512, max_position_embeddings=32_768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
SMOKE = dict(GEMMA3_270M, vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
             num_attention_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=8)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The highest resident set size seen while the block runs (sampled every 2 ms)."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def build(side: str, cfg: dict):
    """(model, step function (tokens, targets) -> loss tensor) for one side, random weights."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    hf_cfg = Gemma3TextConfig(**cfg, attn_implementation="sdpa")
    if side == "transformers":
        torch.manual_seed(0)
        model = Gemma3ForCausalLM(hf_cfg).train()

        def step(tokens, targets):
            return model(input_ids=tokens, labels=targets, shift_labels=targets).loss
        return model, step
    from lmforge.export.hf_in import model_config_from_hf
    from lmforge.model import Transformer

    config = hf_cfg.to_dict()
    config.update(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"])
    mc = model_config_from_hf(config, "bench")
    model = Transformer(replace(mc, vocab_size=cfg["vocab_size"])).train()

    def step(tokens, targets):
        return model(tokens, targets=targets) / targets.numel()  # the mean, as transformers' loss
    return model, step


def run_side(side: str, cfg: dict, batch: int, seq_len: int, warmup: int, repeat: int) -> dict:
    from lmforge.runtime import resolve_precision

    torch.manual_seed(0)
    model, step = build(side, cfg)
    bf16 = resolve_precision("auto", torch.device("cpu")) == torch.bfloat16  # lmforge's own choice, both sides
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg["vocab_size"], (batch, seq_len), generator=g)
    targets = torch.roll(tokens, -1, 1)
    times = []

    def one():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = step(tokens, targets)
        loss.backward()
        return float(loss.detach())

    for _ in range(warmup):
        one()
    with PeakRss() as mem:
        for _ in range(repeat):
            t = time.perf_counter()
            loss = one()
            times.append(time.perf_counter() - t)
    return {"side": side, "step_s": statistics.median(times), "peak_bytes": mem.peak - mem.base, "loss": loss,
            "bf16": bf16, "params": sum(p.numel() for p in model.parameters())}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    common.smoke_flag(ap)
    ap.add_argument("--side", choices=("lmforge", "transformers"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    cfg = SMOKE if a.smoke else GEMMA3_270M
    if a.side:
        print(json.dumps(run_side(a.side, cfg, a.batch, a.seq_len, a.warmup, a.repeat)))
        return {}
    rows = {}
    for side in ("transformers", "lmforge"):
        cmd = [sys.executable, __file__, "--side", side, "--batch", str(a.batch), "--seq-len", str(a.seq_len),
               "--warmup", str(a.warmup), "--repeat", str(a.repeat)] + (["--smoke"] if a.smoke else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows[side] = json.loads(out.strip().splitlines()[-1])
    t, lm = rows["transformers"], rows["lmforge"]
    title = (f"Gemma 3 {'smoke' if a.smoke else '270M'} shape ({lm['params'] / 1e6:.0f}M parameters), a training step "
             f"of {a.batch} x {a.seq_len} tokens, {'bf16 autocast' if lm['bf16'] else 'float32'}, median of "
             f"{a.repeat} steps; {common.machine_line()}" + (" (SMOKE RUN: figures mean nothing)" if a.smoke else ""))
    print(common.table(
        ["", "step s", "peak MiB (step)", "loss"],
        [[side, f"{rows[side]['step_s']:.3f}", f"{rows[side]['peak_bytes'] / 2**20:.0f}", f"{rows[side]['loss']:.4f}"]
         for side in ("transformers", "lmforge")]
        + [["lmforge / transformers", f"{lm['step_s'] / t['step_s']:.2f}x (goal <= 1.2x)",
            f"{lm['peak_bytes'] / max(t['peak_bytes'], 1):.2f}x (goal <= 1.3x)", ""]], title=title))
    return rows


if __name__ == "__main__":
    main()
