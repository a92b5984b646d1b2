"""The preflight plan: what a training run will cost, before it runs.

`make_plan(trainer)` describes a run from its trainer (the model, the optimizer, the config):

- parameters, total and trainable;
- memory per rank (MiB): weights, gradients (trainable parameters, their dtype), optimizer
  state (AdamW: two float32 moments per trainable parameter; Muon: one momentum buffer per
  matrix it takes, AdamW's two for the rest — `lmforge.train.optim`), and activations of one
  micro-batch (`lmforge.model.memory.activation_bytes`, the one estimate: B x T x n_layers x
  (12 dim + 4 ffn) elements of the compute dtype, plus the loss's float32 chunk). A rough
  figure: on this project's CPU (2026-11-24, 5 shapes of 2 to 8 layers, fp32 and bf16) the memory the steps added came to 1.0-1.3 x the estimate of gradients + optimizer
  state + activations, and 2.1 x for a 2-layer dim-128 model (fixed costs dominate), so the
  dry run prints the measured peak beside it;
- model FLOPs per token: 6 x the non-embedding parameters + 12 x n_layers x dim x seq_len
  (Kaplan et al. 2020, arXiv 2001.08361; the attention term as in nanoGPT's `estimate_mfu`),
  and the same with the output head (+ 6 x dim x vocab);
- with `measure=True` (the dry run: the trainer is thrown away after): `steps` real optimizer
  steps after one warm-up step (more, up to 20, until they add up to a second), timed — tokens per second (median), the time to finish the
  configured steps (the first step's time + the median x the rest; and where
  `train.time_limit_s` stops it first) — and the peak memory of
  those steps: CUDA `torch.cuda.max_memory_allocated`, CPU the process's peak resident set
  (VmHWM after resetting it through /proc/self/clear_refs; where the kernel does not allow
  that, the peak of the whole process, said so) minus the resident set before the steps.

The plan is printed (`plan_lines`) and written to the run folder as `plan.json` (a real run:
the estimates only, measured figures need extra steps that would change the run).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from lmforge.model.memory import activation_bytes, memory_need
from lmforge.train.optim import group_kind

PLAN_FILE = "plan.json"
MIB = 1 << 20
#: The dry run times at least `steps` steps, and more (up to MAX_MEASURE_STEPS) until they add up to
#: MIN_MEASURE_S seconds, so that the median of short steps is not one scheduler hiccup.
MIN_MEASURE_S = 1.0
MAX_MEASURE_STEPS = 20


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_estimate(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg, compute_bytes: int,
                    rows_per_sample: int = 1) -> dict:
    """The memory estimate per rank in MiB (module docstring)."""
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    trainable = [p for p in params if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in trainable)
    state = 0
    for g in optimizer.param_groups:
        n = sum(p.numel() for p in g["params"])
        state += n * 4 * (1 if group_kind(g) == "muon" else 2)
    rows = cfg.train.micro_batch_size * rows_per_sample
    activations = activation_bytes(model.config, rows * cfg.data.seq_len, compute_bytes,
                                   cfg.train.activation_checkpointing)
    out = {"weights_mib": weights / MIB, "gradients_mib": grads / MIB, "optimizer_state_mib": state / MIB,
           "activations_mib": activations / MIB}
    out = {k: round(v, 1) for k, v in out.items()}
    out["total_mib"] = round(sum(out.values()), 1)  # the sum of the figures shown
    return out


def flops_per_token(model: torch.nn.Module, seq_len: int) -> dict:
    c = model.config
    base = 6 * model.num_parameters(non_embedding=True) + 12 * c.n_layers * c.dim * seq_len
    return {"model_flops_per_token": float(base), "model_flops_per_token_with_head": float(base + 6 * c.dim * c.vocab_size)}


def make_plan(trainer, measure: bool = False, steps: int = 3) -> dict:
    """The plan of `trainer`'s run (module docstring). `measure` takes 1 + `steps` real steps
    (only for a trainer that is thrown away after: the dry run). Rows per micro-batch item and
    tokens per step are the trainer's objective's."""
    cfg, model = trainer.cfg, trainer.raw_model
    t = cfg.train
    world = trainer.dist.world_size
    rows_per_sample = trainer.objective.rows_per_sample
    tokens_per_step = trainer.objective.tokens_per_step(t.micro_batch_size, t.grad_accum_steps, world, cfg.data.seq_len)
    compute_bytes = torch.empty((), dtype=trainer.runtime.dtype or torch.float32).element_size()
    plan = {
        "parameters": model.num_parameters(),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "ranks": world,
        "tokens_per_step": tokens_per_step,
        "steps": t.steps,
        "device": trainer.runtime.label,
        "memory_estimate_per_rank": memory_estimate(model, trainer.optimizer, cfg, compute_bytes, rows_per_sample),
        **flops_per_token(model, cfg.data.seq_len),
    }
    if measure:
        plan.update(measure_steps(trainer, steps, tokens_per_step))
        m = plan["memory_estimate_per_rank"]
        plan["estimated_growth_mib"] = round(m["total_mib"] - m["weights_mib"], 1)
    return plan


def measure_steps(trainer, steps: int, tokens_per_step: int) -> dict:
    """Time 1 + `steps` real optimizer steps of `trainer` (the first is warm-up) and their peak memory."""
    cuda = trainer.device.type == "cuda"
    trainer.optimizer.zero_grad(set_to_none=True)
    if cuda:  # the peak from here on: gradients, optimizer state and activations come on top of the weights
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(trainer.device)
        base = torch.cuda.memory_allocated(trainer.device)
        how = "torch.cuda.max_memory_allocated over the steps"
    else:
        reset = _reset_peak_rss()
        base = (_status_kb("VmRSS") or 0) * 1024
        how = ("peak resident set (VmHWM) over the steps" if reset else
               "peak resident set of the whole process (VmHWM could not be reset)")
    t0 = time.perf_counter()
    trainer.train_step()  # warm-up: first-call allocations, kernel choices
    if cuda:
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    times: list[float] = []
    while len(times) < steps or (sum(times) < MIN_MEASURE_S and len(times) < MAX_MEASURE_STEPS):
        t0 = time.perf_counter()
        trainer.train_step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if cuda:
        peak = torch.cuda.max_memory_allocated(trainer.device)
    else:
        peak = (_status_kb("VmHWM") or 0) * 1024
    step_s = statistics.median(times)
    cfg = trainer.cfg.train
    eta = first_s + step_s * max(cfg.steps - 1, 0)  # a run pays the first step's set-up too
    out = {"measured_steps": len(times), "step_seconds": round(step_s, 4), "first_step_seconds": round(first_s, 4),
           "tokens_per_second": round(tokens_per_step / step_s, 1), "time_to_finish_seconds": round(eta, 1),
           "measured_peak_mib": round(peak / MIB, 1), "measured_growth_mib": round(max(peak - base, 0) / MIB, 1),
           "memory_measured_as": how}
    if cfg.time_limit_s and cfg.time_limit_s < eta:
        out["time_limit_stops_at_step"] = int(cfg.time_limit_s / step_s)
    return out


def plan_lines(plan: dict) -> str:
    m = plan["memory_estimate_per_rank"]
    lines = [f"plan: {plan['parameters']:,} parameters ({plan['trainable_parameters']:,} trainable), "
             f"{plan['tokens_per_step']:,} tokens/step x {plan['steps']:,} steps on {plan['ranks']} rank(s), "
             f"{plan['device']}",
             f"plan: memory per rank (estimate) {m['total_mib']:,.0f} MiB = weights {m['weights_mib']:,.0f} + gradients "
             f"{m['gradients_mib']:,.0f} + optimizer state {m['optimizer_state_mib']:,.0f} + activations "
             f"{m['activations_mib']:,.0f}; {plan['model_flops_per_token'] / 1e6:,.1f} MFLOP/token "
             f"({plan['model_flops_per_token_with_head'] / 1e6:,.1f} with the output head)"]
    if "tokens_per_second" in plan:
        eta = plan["time_to_finish_seconds"]
        lines.append(f"plan: measured over {plan['measured_steps']} steps: {plan['tokens_per_second']:,.0f} tokens/s "
                     f"({plan['step_seconds']:.3f} s/step), {eta / 60:,.1f} min to finish {plan['steps']:,} steps"
                     + (f" (train.time_limit_s stops it near step {plan['time_limit_stops_at_step']:,})"
                        if "time_limit_stops_at_step" in plan else "")
                     + f"; peak memory {plan['measured_peak_mib']:,.0f} MiB ({plan['memory_measured_as']}), "
                       f"{plan['measured_growth_mib']:,.0f} MiB of it added by the steps (estimate: "
                       f"{plan['estimated_growth_mib']:,.0f} MiB of gradients, optimizer state and activations)")
    return "\n".join(lines)


#: The share of the available memory `auto_micro_batch` plans a step into (the activation estimate
#: is rough: the measured need came to up to 2.1x a formula of this kind, see the module docstring).
AUTO_MEMORY_SHARE = 0.4


def mixture_plan(plan: dict, stream, cfg, world: int) -> None:
    """plan.json's "mixture" for a stream of several sources (`MixtureStream.plan_report`): the
    rows each source gives to the run's train.steps (on `world` ranks), their share and the epochs
    they make. Nothing for a stream of one source."""
    if hasattr(stream, "plan_report"):
        t = cfg.train
        plan["mixture"] = stream.plan_report(t.steps * t.micro_batch_size * t.grad_accum_steps * world)


def auto_micro_batch(model_cfg, seq_len: int, rows_per_rank: int, available: int) -> tuple[int, str]:
    """`train.micro_batch_size = "auto"`: the largest divisor of `rows_per_rank` (the global
    batch over the data-parallel ranks) whose step fits AUTO_MEMORY_SHARE of `available` bytes
    by `model.memory.memory_need`'s estimate (at least 1). Returns (rows, why)."""
    fixed, per_token = memory_need(model_cfg, training=True)
    budget = available * AUTO_MEMORY_SHARE - fixed
    fit = max(int(budget // (per_token * seq_len)), 1)
    micro = max(d for d in range(1, rows_per_rank + 1) if rows_per_rank % d == 0 and d <= fit)
    why = (f"{micro} rows fit {AUTO_MEMORY_SHARE:.0%} of the {available / 2**30:,.1f} GiB available "
           f"(about {per_token * seq_len / MIB:,.1f} MiB a row and {fixed / MIB:,.0f} MiB of weights, gradients and "
           f"optimizer state)")
    return micro, why


__all__ = ["auto_micro_batch", "AUTO_MEMORY_SHARE", "make_plan", "mixture_plan", "plan_lines", "memory_estimate",
           "flops_per_token", "PLAN_FILE"]
