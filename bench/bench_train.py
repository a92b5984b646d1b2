"""Training throughput: lmforge's training step vs the same model in `transformers` + AdamW.

Both sides get the same shapes, the same initial weights (lmforge's, in the model
`lmforge export` would write: `common.hf_twin`, a Qwen3ForCausalLM for lmforge's default
QK-norm model, else a LlamaForCausalLM), the same batches (two RowStreams over the same random tokens, one
full-length document per row, so attention is plain causal on both sides), the same
precision (fp32, or bf16 autocast around the forward), the same AdamW hyper-parameters
and gradient clipping at 1.0. They run interleaved in one process.

- lmforge: `Trainer.train_step` (draw the micro-batch, forward, `cross_entropy_sum`,
  backward, clip, AdamW from `build_optimizer`) — exactly what `lmforge pretrain` runs with
  `train.optimizer = "adamw"` (pinned here: the default, Muon, is not the reference's optimizer).
- transformers: `model(input_ids, labels=..., shift_labels=targets).loss.backward()`,
  `clip_grad_norm_`, `torch.optim.AdamW` with torch's default implementation choice.

Model FLOPs per token = 6 x non-embedding parameters + 12 x n_layers x dim x seq_len
(the output head is left out, as the formula says; the `MFU +head` column adds
6 x dim x vocab for it). MFU = achieved model FLOP/s over the matmul rate measured in the
same run for that precision (2048^3 `torch.mm`, measured before each run and at the end;
the best rate seen is the peak).

Run: `python bench/bench_train.py [--configs speedrun,larger] [--warmup 3] [--repeat 5]`;
`--smoke`: a tiny config, one step of each kind, seconds (proves the benchmark runs).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

CONFIGS = {
    # the speedrun model (configs/stdlib-tiny.toml: 4 query / 2 KV heads, vocab 4,096) at its 16 x 256
    "speedrun": dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab=4096, seq_len=256, batch=16),
    # the same model as measured up to 2026-11-26 (8 / 4 heads, vocab 8,192, 8 x 256)
    "speedrun-v1": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab=8192, seq_len=256, batch=8),
    # the larger config: dim 512, 8 layers, seq 512, micro-batch 4 (8 x 512 fits too; 4 keeps it short)
    "larger": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab=8192, seq_len=512, batch=4),
    # a GPU shape (--device cuda): GPT-2 small's width and depth, 8 x 1,024 tokens a step
    "gpu": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab=32768, seq_len=1024, batch=8),
}
#: --smoke: seconds, every code path (both precisions, the profile), figures meaningless
SMOKE_CONFIG = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab=512, seq_len=32, batch=2)
PRECISIONS = ("fp32", "bf16")
RATIO_GOAL = 1.5
MFU_GOAL = 0.5  # of the bf16 matmul peak, at the larger config

# -- matmul peak ---------------------------------------------------------------------------
def matmul_rate(dtype: torch.dtype, n: int = 2048, warmup: int = 2, repeat: int = 6,
                device: str = "cpu") -> common.Stats:
    """GFLOP/s of an n x n x n torch.mm in `dtype` (2 n^3 FLOPs per call; on CUDA, 20 calls
    between synchronisations)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    if device == "cuda":
        def mm():
            for _ in range(20):
                torch.mm(a, b)
            torch.cuda.synchronize()
        return common.interleaved({"mm": mm}, warmup, repeat)["mm"].rate(20 * 2 * n**3 / 1e9)
    stats = common.interleaved({"mm": lambda: torch.mm(a, b)}, warmup, repeat)["mm"]
    return stats.rate(2 * n**3 / 1e9)


# -- the two sides -----------------------------------------------------------------------------
def random_stream(spec: dict, seed: int = 0, n_samples: int = 64):
    """A RowStream over random tokens: n_samples documents of seq_len + 1 tokens, one per row."""
    from lmforge.data.packing import RowStream

    T = spec["seq_len"]
    data = np.random.default_rng(seed).integers(0, spec["vocab"], size=(n_samples, T + 1), dtype=np.int64)

    def get_tokens(s: int, start: int, stop: int) -> np.ndarray:
        return data[s, start:stop]

    return RowStream(np.full(n_samples, T), get_tokens, None, T, spec["batch"], pad_id=0, seed=seed)


def lmforge_config(spec: dict, precision: str, compile: bool = False):
    from lmforge.config import Config, ModelConfig

    cfg = Config()
    cfg.model = ModelConfig(dim=spec["dim"], n_layers=spec["n_layers"], n_heads=spec["n_heads"],
                            n_kv_heads=spec["n_kv_heads"], vocab_size=spec["vocab"],
                            max_seq_len=spec["seq_len"], attention="sdpa")
    cfg.data.seq_len = spec["seq_len"]
    t = cfg.train
    t.micro_batch_size, t.grad_accum_steps, t.precision = spec["batch"], 1, precision
    t.lr, t.warmup_steps, t.steps, t.compile = 1e-3, 2, 1_000_000, compile
    t.optimizer = "adamw"  # the reference's optimizer (the default, muon, would compare two optimizers)
    return cfg.validate()


def build_lmforge(spec: dict, precision: str, workdir: Path, compile: bool = False, device: str = "cpu"):
    from lmforge.model import Transformer
    from lmforge.train.distributed import DistInfo
    from lmforge.train.trainer import Trainer

    cfg = lmforge_config(spec, precision, compile)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    model.reset_parameters(seed=0)
    trainer = Trainer(cfg, workdir / "run", workdir, model, random_stream(spec), dist=DistInfo(device=torch.device(device)),
                      progress=False)
    return trainer


def build_hf(spec: dict, precision: str, lm_model: torch.nn.Module, lr: float, compile: bool = False,
             device: str = "cpu"):
    """The transformers model `lmforge export` would write, with lmforge's initial weights
    (`common.hf_twin`, sdpa attention), and a step function."""
    from lmforge.runtime import autocast

    model = common.hf_twin(lm_model.cpu(), common.synthetic_contract(spec["vocab"]), use_cache=False)
    lm_model.to(device)
    model.to(device).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    dtype = torch.bfloat16 if precision == "bf16" else None
    device = torch.device(device)
    stream = random_stream(spec)
    fwd = torch.compile(model) if compile else model

    def step() -> float:
        b = stream.next_batch().to(device)
        with autocast(device, dtype):
            out = fwd(input_ids=b.tokens, labels=b.targets, shift_labels=b.targets)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(out.loss.detach())

    return model, step


# -- profile ----------------------------------------------------------------------------------
_BUCKETS = [
    ("matmul", r"aten::(mm|addmm|bmm|matmul|linear|_mkldnn|mkldnn_)|onednn"),
    ("attention", r"scaled_dot_product|flash_attention|_efficient_attention|_sdpa"),
    ("loss", r"log_softmax|_softmax|nll_loss|cross_entropy|logsumexp|LinearCrossEntropy"),
    ("optimizer", r"_foreach_|adamw|_fused_adam|lerp|addcdiv|addcmul"),
    ("copy / cast", r"aten::(copy_|_to_copy|to|clone|contiguous|cat|_local_scalar_dense)$"),
    ("norm", r"rms_norm|_fused_rms"),
    ("elementwise", r"aten::(mul|add|sub|div|neg|pow|rsqrt|sqrt|silu|sigmoid|exp|mean|sum|fill_|zero_|zeros|"
                    r"ones|where|clamp|masked_fill|embedding|index|gather|scatter)"),
]


def profile_events(step) -> tuple[list, dict[str, float]]:
    """One call of `step` under torch.profiler: the per-op averages by self CPU time (largest
    first), and self CPU ms per phase (backward, optimizer, the rest), found from each op's
    enclosing autograd-engine or `Optimizer.step` scope."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    phases: dict[str, float] = {}
    for e in prof.events():
        if e.self_cpu_time_total <= 0:
            continue
        phase, node = "forward, loss, clip, data", e
        while node is not None:
            if node.name.startswith("autograd::engine") or node.name.endswith("Backward0"):
                phase = "backward"
                break
            if node.name.startswith("Optimizer."):
                phase = "optimizer (step, zero_grad)"
                break
            node = node.cpu_parent
        phases[phase] = phases.get(phase, 0.0) + e.self_cpu_time_total / 1e3
    return sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True), phases


def group_times(events) -> dict[str, float]:
    """Self CPU ms per op group (see _BUCKETS)."""
    groups: dict[str, float] = {}
    for e in events:
        name = next((g for g, pat in _BUCKETS if re.search(pat, e.key)), "other")
        groups[name] = groups.get(name, 0.0) + e.self_cpu_time_total / 1e3
    return groups


def _side_by_side(ours: dict[str, float], ref: dict[str, float], label: str) -> str:
    total, ref_total = sum(ours.values()) or 1.0, sum(ref.values()) or 1.0
    names = sorted(set(ours) | set(ref), key=lambda g: -ours.get(g, 0.0))
    rows = [(g, f"{ours.get(g, 0.0):,.0f}", f"{100 * ours.get(g, 0.0) / total:.0f}%",
             f"{ref.get(g, 0.0):,.0f}" if ref else "-", f"{100 * ref.get(g, 0.0) / ref_total:.0f}%" if ref else "-")
            for g in names]
    rows.append(("total", f"{total:,.0f}", "100%", f"{ref_total:,.0f}" if ref else "-", "100%" if ref else "-"))
    return common.table([label, "lmforge ms", "share", "transformers ms", "share"], rows)


def profile_steps(step, reference_step=None, top: int = 12) -> tuple[str, dict]:
    """One lmforge step under torch.profiler: its top ops by self CPU time; self time per
    phase and per op group next to one step of the reference."""
    events, phases = profile_events(step)
    total = sum(e.self_cpu_time_total for e in events) / 1e3 or 1.0
    rows = [(e.key[:64], f"{e.self_cpu_time_total / 1e3:,.1f}", f"{100 * e.self_cpu_time_total / 1e3 / total:.1f}%",
             e.count) for e in events[:top]]
    groups = group_times(events)
    ref_groups, ref_phases = {}, {}
    if reference_step is not None:
        ref_events, ref_phases = profile_events(reference_step)
        ref_groups = group_times(ref_events)
    text = common.table(["op", "self CPU ms", "share", "calls"], rows)
    text += "\n\nSelf CPU time by phase and by op group, one step each:\n\n" + _side_by_side(
        phases, ref_phases, "phase") + "\n\n" + _side_by_side(groups, ref_groups, "op group")
    return text, {"top": [dict(zip(("op", "self_ms", "share", "calls"), r)) for r in rows],
                  "groups_ms": groups, "phases_ms": phases, "total_ms": total,
                  "reference_groups_ms": ref_groups, "reference_phases_ms": ref_phases}


# -- main ---------------------------------------------------------------------------------------
def flops_per_token(model, spec: dict) -> tuple[float, float]:
    """(6 N_non-embedding + 12 L d T, the same + 6 d V for the output head)."""
    n = model.num_parameters(non_embedding=True)
    base = 6 * n + 12 * spec["n_layers"] * spec["dim"] * spec["seq_len"]
    return float(base), float(base + 6 * spec["dim"] * spec["vocab"])


def fit_budget(first_s: float, warmup: int, repeat: int, budget_s: float, min_repeat: int = 3) -> tuple[int, int]:
    """(warm-up, repeat) cut down so that the remaining steps of both sides, at `first_s`
    seconds per lmforge + transformers pair, fit in `budget_s` (0 = no budget). Never fewer
    than `min_repeat` timed steps nor less than one warm-up step in all."""
    if budget_s <= 0 or first_s <= 0:
        return warmup, repeat
    pairs = int(budget_s / first_s)
    repeat = max(min(repeat, pairs - (warmup - 1)), min(min_repeat, repeat))
    warmup = max(1, min(warmup, pairs - repeat + 1))
    return warmup, repeat


def run_config(name: str, spec: dict, precision: str, peaks: dict, warmup: int, repeat: int,
               compile: bool, profile: bool, log, budget_s: float = 0.0, device: str = "cpu") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_lmforge(spec, precision, Path(tmp), compile, device)
        hf_model, hf_step = build_hf(spec, precision, trainer.raw_model, trainer.cfg.train.lr, compile, device)
        t0 = time.perf_counter()
        first = {"lmforge": trainer.train_step()["loss"], "transformers": hf_step()}
        first_s = time.perf_counter() - t0
        warmup, repeat = fit_budget(first_s, warmup, repeat, max(budget_s - first_s, 1e-9) if budget_s > 0 else 0.0)
        rss = common.PeakRSS()
        times = common.interleaved({"lmforge": trainer.train_step, "transformers": hf_step},
                                   max(0, warmup - 1), repeat, rss.before, rss.after)
        prof = profile_steps(trainer.train_step, hf_step) if profile else None
        f, f_head = flops_per_token(trainer.raw_model, spec)
        tokens = spec["batch"] * spec["seq_len"]
        peak = peaks[precision]
        row = {"config": name, "precision": precision, "tokens_per_step": tokens, "warmup": warmup, "repeat": repeat,
               "flops_per_token": f, "flops_per_token_with_head": f_head,
               "non_embedding_params": trainer.raw_model.num_parameters(non_embedding=True),
               "params": trainer.raw_model.num_parameters(), "matmul_peak_gflops": peak,
               "first_loss": first, "profile": prof[1] if prof else None, "reference": type(hf_model).__name__}
        for side in ("lmforge", "transformers"):
            tps = times[side].rate(tokens)
            row[side] = {"tokens_per_s": tps.as_dict(), "step_s": times[side].as_dict(),
                         "mfu": tps.median * f / (peak * 1e9), "mfu_with_head": tps.median * f_head / (peak * 1e9),
                         "peak_rss_mb": rss.peak.get(side)}
        row["ratio"] = row["lmforge"]["tokens_per_s"]["median"] / row["transformers"]["tokens_per_s"]["median"]
        del hf_model, trainer
    log(f"  {name} {precision}: lmforge {row['lmforge']['tokens_per_s']['median']:,.0f} tok/s, transformers "
        f"{row['transformers']['tokens_per_s']['median']:,.0f} tok/s ({row['ratio']:.2f}x)")
    if prof:
        row["profile_text"] = prof[0]
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="speedrun,larger", help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per side (the first checks the loss)")
    ap.add_argument("--repeat", type=int, default=5, help="timed steps per side")
    ap.add_argument("--budget", type=float, default=240.0,
                    help="seconds for all configs' steps; fewer steps (>= 3 timed) when the first is slow; 0 = none")
    ap.add_argument("--compile", action="store_true", help="torch.compile both models (slow to start on CPU)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--attention-backward", default="matmul", choices=("matmul", "sdpa"),
                    help="lmforge's attention backward in compiled bf16 CPU training: matmul (the default, "
                         "lmforge.model.cpu_attention) or sdpa (torch's own flash backward, as before)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where both sides run (cuda: the profile is left out; the gpu config fits it)")
    common.smoke_flag(ap)
    args = ap.parse_args([] if argv is None else argv)
    from lmforge.model import cpu_attention

    cpu_attention.CPU_ATTENTION = args.attention_backward == "matmul"
    configs, mm_n, profiled = CONFIGS, 2048, "larger"
    if args.device == "cuda":
        mm_n = 8192  # a GPU's matmul peak needs a large product
    if args.smoke:  # every path once (both precisions, the profile, the RSS probes), tiny
        configs, mm_n, profiled = {"smoke": SMOKE_CONFIG}, 256, "smoke"
        args.configs, args.warmup, args.repeat, args.budget = "smoke", 1, 1, 0.0

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    torch.manual_seed(0)
    # the matmul rate is measured before every run and the best seen is the peak: a busy
    # neighbour during one measurement must not inflate the MFU of the runs
    mm_samples: dict[str, list[float]] = {"fp32": [], "bf16": []}

    def measure_peaks() -> dict[str, float]:
        for p, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            mm_samples[p] += matmul_rate(dtype, n=mm_n, repeat=4, device=args.device).samples
        return {p: max(v) for p, v in mm_samples.items()}

    peaks = measure_peaks()
    log(f"  matmul {mm_n}^3: fp32 {peaks['fp32']:.0f} GFLOP/s, bf16 {peaks['bf16']:.0f} GFLOP/s")
    rows = []
    runs = [(n, p) for n in args.configs.split(",") for p in args.precisions.split(",")]
    # each run's share of the budget, weighted by its tokens x FLOPs (the larger config costs ~8x)
    weight = {r: configs[r[0]]["batch"] * configs[r[0]]["seq_len"] * configs[r[0]]["dim"] ** 2
              * configs[r[0]]["n_layers"] * (2 if r[1] == "fp32" else 1) for r in runs}
    for name, precision in runs:
        profile = (not args.no_profile) and name == profiled and precision == "bf16" and args.device == "cpu"
        budget = args.budget * weight[(name, precision)] / sum(weight.values())
        rows.append(run_config(name, configs[name], precision, measure_peaks(), args.warmup, args.repeat,
                               args.compile, profile, log, budget, args.device))
    peaks = measure_peaks()
    for r in rows:  # MFU against the best rate of the whole run
        r["matmul_peak_gflops"] = peaks[r["precision"]]
        for side in ("lmforge", "transformers"):
            tps = r[side]["tokens_per_s"]["median"]
            r[side]["mfu"] = tps * r["flops_per_token"] / (peaks[r["precision"]] * 1e9)
            r[side]["mfu_with_head"] = tps * r["flops_per_token_with_head"] / (peaks[r["precision"]] * 1e9)
    mm = {p: common.Stats(v) for p, v in mm_samples.items()}

    mm_table = common.table(
        [f"matmul {mm_n}^3", "GFLOP/s best", "median", "min-max"],
        [(p, f"{s.max:,.0f}", f"{s.median:,.0f}", s.spread()) for p, s in mm.items()],
        title="Matmul rate (the MFU denominator: the best seen, measured before each run and at the end)")
    body = []
    for r in rows:
        lm, hf = r["lmforge"], r["transformers"]
        goal_mfu = MFU_GOAL if (r["config"] == "larger" and r["precision"] == "bf16") else None
        rss = f"{lm['peak_rss_mb']:,.0f} / {hf['peak_rss_mb']:,.0f}" if lm["peak_rss_mb"] else "-"
        body.append((
            r["config"], r["precision"],
            f"{lm['tokens_per_s']['median']:,.0f} ({common.Stats([lm['tokens_per_s']['min'], lm['tokens_per_s']['max']]).spread()})",
            f"{hf['tokens_per_s']['median']:,.0f} ({common.Stats([hf['tokens_per_s']['min'], hf['tokens_per_s']['max']]).spread()})",
            common.fmt_ratio(r["ratio"], RATIO_GOAL),
            common.fmt_pct(lm["mfu"], goal_mfu) + f" / {100 * lm['mfu_with_head']:.1f}%",
            f"{100 * hf['mfu']:.1f}% / {100 * hf['mfu_with_head']:.1f}%",
            rss,
        ))
    shapes = "; ".join(
        f"{n}: dim {s['dim']}, {s['n_layers']} layers, {s['n_heads']}/{s['n_kv_heads']} heads, vocab {s['vocab']}, "
        f"batch {s['batch']} x {s['seq_len']}" for n, s in configs.items() if n in args.configs.split(","))
    main_table = common.table(
        ["config", "precision", "lmforge tok/s (min-max)", "transformers tok/s (min-max)",
         f"ratio (goal {RATIO_GOAL}x)", "lmforge MFU / +head", "transformers MFU / +head", "peak RSS MB lm / hf"],
        body, title=f"Training step: lmforge vs transformers {rows[0]['reference']} + AdamW"
                    + (" (SMOKE RUN: figures mean nothing)" if args.smoke else ""))
    notes = [
        f"shapes: {shapes}.",
        "medians over interleaved steps per side; warm-up + timed steps: "
        + ", ".join(f"{r['config']} {r['precision']} {r['warmup']}+{r['repeat']}" for r in rows)
        + f" (asked: {args.warmup}+{args.repeat}; fewer where the first step showed they would not fit "
        f"--budget {args.budget:g}s)" + (", torch.compile on both" if args.compile else "") + ".",
        "MFU = tokens/s x model FLOPs per token / the matmul rate of the row's precision (best of the run); "
        "model FLOPs per token = 6 x non-embedding params + 12 x n_layers x dim x seq_len; "
        "'+head' adds 6 x dim x vocab for the output layer.",
        "peak RSS: the process's peak during that side's timed steps (both models and optimizers resident).",
    ]
    for r in rows:
        d = abs(r["first_loss"]["lmforge"] - r["first_loss"]["transformers"])
        notes.append(f"{r['config']} {r['precision']}: {r['non_embedding_params']:,} non-embedding params, "
                     f"{r['flops_per_token'] / 1e6:.1f} MFLOP/token; first-step loss lmforge "
                     f"{r['first_loss']['lmforge']:.4f} vs transformers {r['first_loss']['transformers']:.4f} "
                     f"(|diff| {d:.1e}).")
    text = mm_table + "\n\n" + main_table + "\n\n" + "\n".join(f"- {n}" for n in notes)
    for r in rows:
        if r.get("profile_text"):
            text += (f"\n\n### Where the time goes: lmforge {r['precision']} step at the {r['config']} config "
                     f"(torch.profiler, top ops by self CPU time; op groups next to transformers')\n\n" + r["profile_text"])
    print(text, flush=True)
    for r in rows:
        r.pop("profile_text", None)
    return {"benchmark": "train", "matmul_gflops": {p: s.as_dict() for p, s in mm.items()},
            "rows": rows, "warmup": args.warmup, "repeat": args.repeat, "configs": configs, "smoke": args.smoke,
            "seconds": round(time.perf_counter() - t_start, 1)}


if __name__ == "__main__":
    main(sys.argv[1:])
