"""The GPU path in one prepared check (issue 48): one command, one table, on one H100/H200.

    python3 bench/gpu_check.py [--json PATH] [--only ROW[,ROW]] [--logs DIR]
    python3 bench/gpu_check.py --smoke          # rows 2-4 on a CPU, tiny, ~40 s (1 and 5 skipped)

Rows (each in its own process, with its own time limit; a row that raises, crashes or hangs
is a FAIL with its error's last line, the others still run; exit 1 when any row failed):

  pytest          1   the CUDA tests: `python -m pytest -q -m cuda` on the test files that hold
                      CUDA tests, plus the tests whose skip reason names CUDA but that carry no
                      `cuda` mark (this module is also that pytest plugin: `-p gpu_check`);
                      passed / failed / skipped and the failing ids
  grads-pretrain  2a  compiled (`torch.compile`, as `train.compile` does) against eager gradients
  grads-sft       2b  of one micro-batch of each objective, through the objective's own `loss`
  grads-dpo       2c  (`TokenObjective` on packed pretraining rows and on packed SFT rows with
  grads-rl        2d  document_ids, `DPOObjective` on packed pairs with a live reference,
                      `RLObjective` on packed rollouts with a KL term), bf16 autocast, the attention
                      `auto` picks (flex on CUDA). Per parameter group (embedding, attention, mlp,
                      norms, head): the relative difference of the gradient norms and the largest
                      relative error ||g_compiled - g_eager|| / ||g_eager|| of a tensor, against
                      the tolerances in GRAD_TOL; eager bf16 against eager fp32 beside it (the
                      noise floor of bf16 itself)
  flex            3   FlexAttention against sdpa on packed rows (document_ids): the attention
                      function (fp32 and bf16, GQA; output and dq, dk, dv) and the whole model
                      (bf16 autocast; loss and every parameter's gradient)
  step            4   the training step at GPT-2 small's shape (dim 768, 12 layers, 12 query /
                      4 KV heads, vocab 32,768, 8 x 1,024 tokens, bf16 autocast, AdamW on both),
                      compiled on both sides: lmforge's `Trainer.train_step` against transformers'
                      LlamaForCausalLM (sdpa attention, torch.compile) with the same initial
                      weights; tokens/s, the ratio, MFU against the measured bf16 matmul peak
  speedrun        5   `python -m lmforge speedrun --config configs/stdlib-tiny.toml
                      --set train.time_budget_s=60`: the pretraining stage's held-out bits per
                      byte and wall seconds (the whole speedrun runs: it has no flag to stop
                      after pretraining; SFT ~20 s on an H200)

MFU (PaLM, Chowdhery et al. 2022, arXiv 2204.02311, appendix B; nanoGPT's `estimate_mfu`):
model FLOPs per token = 6 N + 12 L d T, N the parameters that take part in matrix products
(every non-embedding weight and the output head; the input embedding is a lookup, not a
product), L layers, d = n_heads x head_dim the attention width, T the sequence length (the
attention term counts the full T x T scores, as both references do, not the causal half).
MFU = tokens/s x FLOPs per token / the best rate of an 8192^3 bf16 `torch.mm` measured in the
same process before and after the timed steps (H100/H200: ~790 TFLOP/s, not the 989 of the
data sheet).

Time on one H100/H200 (estimates, not yet measured: rows 1-3 run side by side, `--jobs`, while
row 4 compiles both models; row 4 then times its steps alone, then row 5 runs alone): row 1 about
90 s, each of 2a-2d and 3 about 60-80 s (three flex compiles and an inductor compile of the
4-layer model), so rows 1-3 about 2.5 min; row 4 about 20 s after them when its compile (2-3
min) is done; row 5 about 2-2.5 min (tokenizer, prepare, 60 s of pretraining, evaluation, SFT);
about 5-6 min in all. `--deadline` (470 s) caps it: rows 1-3 are stopped at 280 s, row 4 at 320 s,
and row 5 keeps 150 s.

Needs on the GPU machine: torch with CUDA, transformers, numpy, tokenizers, safetensors, tqdm,
jinja2, matplotlib, pytest, and lmforge's tomli-w and zstandard (wheels in .whl/, see
bench/README.md); lmforge from `src/` (PYTHONPATH), no `pip install -e .` needed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import common  # noqa: E402  (puts ROOT/src on sys.path)

# -- the rows ---------------------------------------------------------------------------------
ROWS = ("pytest", "grads-pretrain", "grads-sft", "grads-dpo", "grads-rl", "flex", "step", "speedrun")
NUMBER = {"pytest": "1", "grads-pretrain": "2a", "grads-sft": "2b", "grads-dpo": "2c", "grads-rl": "2d",
          "flex": "3", "step": "4", "speedrun": "5"}
TITLE = {
    "pytest": "CUDA tests (pytest -m cuda)",
    "grads-pretrain": "compiled vs eager gradients: pretraining (packed rows)",
    "grads-sft": "compiled vs eager gradients: SFT (packed conversations)",
    "grads-dpo": "compiled vs eager gradients: DPO (packed pairs, live reference)",
    "grads-rl": "compiled vs eager gradients: RL (packed rollouts, KL term)",
    "flex": "FlexAttention vs sdpa on packed rows",
    "step": "training step, GPT-2 small shape, compiled: lmforge vs transformers",
    "speedrun": "speedrun: the pretraining stage's bits per byte",
}
ALIASES = {"grads": [r for r in ROWS if r.startswith("grads-")], "all": list(ROWS)}
#: rows that run side by side (correctness only); "step" and "speedrun" time things and run alone
PARALLEL = ("pytest", "grads-pretrain", "grads-sft", "grads-dpo", "grads-rl", "flex")

#: seconds a row may take from its start (the full run; --smoke: SMOKE_TIMEOUT each)
TIMEOUT = {"pytest": 240, "grads-pretrain": 200, "grads-sft": 200, "grads-dpo": 200, "grads-rl": 200,
           "flex": 150, "step": 330, "speedrun": 240}
SMOKE_TIMEOUT = 200
#: what the rows after the correctness rows need at least (the deadline keeps it for them)
RESERVE = {"speedrun": 150, "step": 40}

#: compiled against eager, per parameter group: the relative difference of the gradient norms,
#: and the largest relative error of one tensor's gradient (bf16: at least this, or
#: `floor_factor` x the same error of eager bf16 against eager fp32 in that group, whichever is
#: larger: a norm weight's gradient is a sum with cancellation, its bf16 error alone is ~2e-2)
GRAD_TOL = {"bf16": {"norm": 2e-2, "tensor": 5e-2, "floor_factor": 3.0},
            "fp32": {"norm": 1e-4, "tensor": 1e-3, "floor_factor": 0.0}}
#: FlexAttention against sdpa: relative L2 error of the attention output and of dq, dk, dv
#: (fp32 without TF32, and bf16); the whole model in bf16 autocast: the loss, and each
#: parameter's gradient as GRAD_TOL["bf16"] with sdpa bf16 against sdpa fp32 as the floor
FLEX_TOL = {"fp32": 1e-4, "bf16": 2e-2, "model_loss": 1e-2}
#: the speedrun's held-out bits per byte must be below this: a model that trained at all (the
#: untrained model's ln 4096 nats a token is about 3 bits a byte; 60 s on an H200 gave 1.51,
#: bench/RESULTS.md 2026-11-26)
SPEEDRUN_MAX_BPB = 2.0
#: the first-step losses of lmforge and transformers (same weights, same batch, bf16) agree to this
STEP_FIRST_LOSS_TOL = 5e-2

GPU_SHAPES = {
    # the grads and flex rows: the speedrun recipe's model (configs/stdlib-tiny.toml; head_dim 64)
    "small": dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=256, batch=8, vocab=1024),
    # bench_train.py's "gpu" config: GPT-2 small's width and depth, 8 x 1,024 tokens a step
    "step": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab=32768, seq_len=1024, batch=8),
}
SMOKE_SHAPES = {
    "small": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=64, batch=2, vocab=512),
    "step": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab=512, seq_len=32, batch=2),
}
#: the tiny speedrun of --smoke (about 30 s on 2 CPU cores, most of it the evaluation suite)
SMOKE_SPEEDRUN_SETS = ["tokenizer.vocab_size=512", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
                       "model.n_kv_heads=2", "train.compile=false",
                       "train.micro_batch_size=4", "data.seq_len=64", "train.eval_every=0",
                       "train.checkpoint_every=0", "sft.steps=1", "sft.max_examples=32", "sft.val_examples=8"]


def expand_only(text: str) -> list[str]:
    """`--only` names (rows, "grads", "all"), in table order. Raises SystemExit on an unknown name."""
    wanted: set[str] = set()
    for name in (n.strip() for n in text.split(",") if n.strip()):
        if name in ALIASES:
            wanted.update(ALIASES[name])
        elif name in ROWS:
            wanted.add(name)
        elif f"grads-{name}" in ROWS:  # pretrain, sft, dpo, rl
            wanted.add(f"grads-{name}")
        elif name in NUMBER.values():
            wanted.update(r for r, n in NUMBER.items() if n == name)
        elif name == "2":
            wanted.update(ALIASES["grads"])
        else:
            raise SystemExit(f"--only: unknown row {name!r}; expected some of {', '.join(ROWS)}, grads, all "
                             f"(pretrain, sft, dpo, rl for the grads rows; or their numbers 1, 2, 2a-2d, 3, 4, 5)")
    return [r for r in ROWS if r in wanted]


def last_line(text: str) -> str:
    """The last non-empty line of `text` (an exception's message, a log's end)."""
    lines = [x.strip() for x in str(text).strip().splitlines() if x.strip()]
    return lines[-1] if lines else ""


def fmt_flops(x: float) -> str:
    """A FLOP/s rate in TFLOP/s, or GFLOP/s below one TFLOP/s (a CPU's)."""
    if x >= 1e12:
        return f"{x / 1e12:,.0f} TFLOP/s" if x >= 1e13 else f"{x / 1e12:,.1f} TFLOP/s"
    return f"{x / 1e9:,.1f} GFLOP/s"


def fmt(x: float | None, spec: str = ".1e") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


# -- comparing gradients -----------------------------------------------------------------------------
GROUPS = ("embedding", "attention", "mlp", "norms", "head")


def param_group(name: str) -> str:
    """The parameter group of an lmforge parameter name (for the per-group figures)."""
    if name.startswith("tok_embeddings"):
        return "embedding"
    if name.startswith("output"):
        return "head"
    if "norm" in name.rsplit(".", 2)[-2]:  # attention_norm, ffn_norm, q_norm, k_norm, norm
        return "norms"
    if ".attention." in name:
        return "attention"
    if ".feed_forward." in name:
        return "mlp"
    return "other"


def compare_grads(test: dict, ref: dict, floor_ref: dict | None, tol: dict) -> dict:
    """Per group: `norm_rel` |‖test‖ - ‖ref‖| / ‖ref‖ over the group's gradients; `max_rel` the
    largest ‖test - ref‖ / ‖ref‖ of one tensor (`worst` names it); `floor` the same largest
    error of `ref` against `floor_ref` (bf16 against fp32, when given); `tol_tensor` the
    tolerance applied; `ok`. Plus "all": the same over every gradient, and `problems`."""
    import torch

    problems = []
    missing = sorted(set(ref) ^ set(test))
    if missing:
        problems.append(f"gradient present on one side only: {', '.join(missing[:4])}")
    groups: dict[str, dict] = {}
    for name in sorted(set(ref) & set(test)):
        g = groups.setdefault(param_group(name), {"t2": 0.0, "r2": 0.0, "max_rel": 0.0, "worst": "", "floor": 0.0,
                                                  "tensors": 0})
        t, r = test[name].double(), ref[name].double()
        if not (torch.isfinite(t).all() and torch.isfinite(r).all()):
            problems.append(f"non-finite gradient: {name}")
            continue
        rn = float(r.norm())
        g["t2"] += float(t.norm()) ** 2
        g["r2"] += rn ** 2
        g["tensors"] += 1
        rel = float((t - r).norm()) / max(rn, 1e-30) if rn > 0 or float(t.norm()) > 0 else 0.0
        if not g["worst"] or rel > g["max_rel"]:
            g["max_rel"], g["worst"] = rel, name
        if floor_ref is not None and name in floor_ref:
            f = floor_ref[name].double()
            fn = float(f.norm())
            g["floor"] = max(g["floor"], float((r - f).norm()) / max(fn, 1e-30) if fn > 0 else 0.0)
    out: dict[str, dict] = {}
    t_all = r_all = 0.0
    for name, g in groups.items():
        t_all, r_all = t_all + g["t2"], r_all + g["r2"]
        tn, rn = math.sqrt(g["t2"]), math.sqrt(g["r2"])
        norm_rel = abs(tn - rn) / rn if rn > 0 else (0.0 if tn == 0 else math.inf)
        tol_tensor = max(tol["tensor"], tol["floor_factor"] * g["floor"]) if floor_ref is not None else tol["tensor"]
        ok = norm_rel <= tol["norm"] and g["max_rel"] <= tol_tensor
        out[name] = {"norm_rel": norm_rel, "max_rel": g["max_rel"], "worst": g["worst"], "floor":
                     g["floor"] if floor_ref is not None else None, "tol_norm": tol["norm"], "tol_tensor": tol_tensor,
                     "norm": tn, "ref_norm": rn, "tensors": g["tensors"], "ok": ok}
        if not ok:
            problems.append(f"{name}: norm diff {norm_rel:.2e} (tol {tol['norm']:.0e}), max rel err "
                            f"{g['max_rel']:.2e} (tol {tol_tensor:.1e}) at {g['worst']}")
    tn, rn = math.sqrt(t_all), math.sqrt(r_all)
    out["all"] = {"norm_rel": abs(tn - rn) / rn if rn > 0 else math.inf, "norm": tn, "ref_norm": rn,
                  "max_rel": max((g["max_rel"] for k, g in out.items()), default=0.0)}
    if rn > 0 and tn == 0:
        problems.insert(0, "the tested gradient norm is exactly 0 (the backward pass lost the gradient)")
    if rn == 0:
        problems.insert(0, "the reference gradient norm is 0: nothing to compare")
    out["problems"] = problems
    return out


def grads_cell(cmp: dict, loss_rel: float, extra: str = "") -> str:
    """The table cell of a gradient comparison: the worst group's figures."""
    groups = [g for g in GROUPS if g in cmp] + [g for g in cmp if g not in GROUPS + ("all", "problems")]
    worst = max(groups, key=lambda g: cmp[g]["max_rel"] / max(cmp[g]["tol_tensor"], 1e-30)) if groups else None
    if worst is None:
        return "no gradients"
    w = cmp[worst]
    floor = f", bf16-vs-fp32 floor {w['floor']:.1e}" if w.get("floor") is not None else ""
    return (f"loss rel diff {loss_rel:.1e}; grad norm rel diff {cmp['all']['norm_rel']:.1e} (tol "
            f"{w['tol_norm']:.0e}/group); max rel err {w['max_rel']:.1e} in {worst} (tol {w['tol_tensor']:.1e}"
            f"{floor})" + extra)


def groups_note(cmp: dict) -> str:
    """Every group's (norm diff / max rel err), for the notes."""
    return "; ".join(f"{g} {cmp[g]['norm_rel']:.1e}/{cmp[g]['max_rel']:.1e}" for g in GROUPS if g in cmp)


# -- the workers' shared set-up ----------------------------------------------------------------------
def device_setup(spec: dict):
    """The worker's torch device; on CUDA, TF32 off (fp32 comparisons mean fp32)."""
    import torch

    device = torch.device(spec["device"])
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: torch.cuda.is_available() is False (run with --smoke on a CPU)")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return device


def texts(spec: dict, n_docs: int, max_chars: int) -> list[str]:
    return common.smoke_texts(n_docs, max_chars)


def small_model(spec: dict, tok, device, seed: int = 0):
    """The grads and flex rows' model (GPU_SHAPES["small"]), random weights (no zero init: every
    gradient is informative), attention as `model.attention = "auto"` resolves it on `device`."""
    from lmforge.config import ModelConfig
    from lmforge.model import Transformer, resolve_model_config
    from lmforge.model.attention import resolve_backend

    s = spec["shape"]
    cfg = resolve_model_config(ModelConfig(dim=s["dim"], n_layers=s["n_layers"], n_heads=s["n_heads"],
                                           n_kv_heads=s["n_kv_heads"], max_seq_len=max(512, s["seq_len"])),
                               tok.contract)
    model = Transformer(cfg)
    model.reset_parameters(seed=seed)
    model.to(device)
    backend = resolve_backend("auto", device, training=True, head_dim=s["dim"] // s["n_heads"])
    model.set_attention(backend)
    return model, backend


def pretrain_batch(spec: dict, tok):
    """Packed pretraining rows with document masking: stdlib documents cut short, several a row."""
    import numpy as np

    from lmforge.data.packing import RowStream

    s = spec["shape"]
    cut = spec["shape"]["seq_len"] * 2  # characters: documents of ~1/4 to ~1 row, several a row
    docs = [np.asarray(tok.encode_document(t[: cut // 4 + (97 * i) % cut]), dtype=np.int64)
            for i, t in enumerate(texts(spec, 120, 4000))]
    return RowStream(np.array([len(d) - 1 for d in docs]), lambda i, a, b: docs[i][a:b], None, s["seq_len"],
                     s["batch"], tok.pad_id, seed=0, packing=True, document_masking=True).next_batch()


def conversations(spec: dict):
    """Chat conversations cut from stdlib documents, sized so that a few share a row."""
    from lmforge.data.conversations import conversation_from_record

    T = spec["shape"]["seq_len"]  # characters below: ~3 a token
    out = []
    for i, t in enumerate(texts(spec, 120, 4000)):
        u = T // 2
        user, reply = t[:u].strip() or "def f():", t[u: u + T // 4 + (61 * i) % T].strip() or "pass"
        out.append(conversation_from_record({"messages": [{"role": "user", "content": user},
                                                          {"role": "assistant", "content": reply}]},
                                            f"gpu_check:{i}"))
    return out


def sft_batch(spec: dict, tok):
    """Packed SFT rows (conversations with document_ids, loss on the assistant's tokens)."""
    from lmforge.data.conversations import render_samples, sft_stream

    s = spec["shape"]
    samples = render_samples(conversations(spec), tok, s["seq_len"])
    return sft_stream(samples, s["seq_len"], s["batch"], tok.pad_id, seed=0, packing=True).next_batch()


def pair_batch(spec: dict, tok):
    """Packed DPO pairs (each side its own segment of a row, `groups` naming it)."""
    from lmforge.data.preferences import PairStream, pair_from_record, render_pairs

    s = spec["shape"]
    src = texts(spec, 120, 4000)
    pairs = []
    u, T = s["seq_len"] // 2, s["seq_len"]  # characters, as in `conversations`
    for i, t in enumerate(src):
        other = src[(i + 7) % len(src)]
        prompt = t[:u].strip()
        chosen, rejected = t[u: u + T // 4 + (61 * i) % (T // 2)].strip(), other[u: u + T // 3].strip()
        if prompt and chosen and rejected and chosen != rejected:
            pairs.append(pair_from_record({"prompt": prompt, "chosen": chosen, "rejected": rejected},
                                          f"gpu_check:{i}"))
    samples = render_pairs(pairs, tok, s["seq_len"])
    return PairStream(samples, s["seq_len"], s["batch"], tok.pad_id, seed=0, packing=True).next_batch()


def rl_batch(spec: dict, tok, cfg):
    """Packed rollouts: `cfg.group_size` completions (stdlib tokens, random lengths, ending with
    the end-of-turn token) of a few chat prompts, random 0/1 rewards (no group all equal)."""
    import torch

    from lmforge.model.loss import group_advantages
    from lmforge.train.rl import build_batch

    s = spec["shape"]
    gen = torch.Generator().manual_seed(0)
    n_prompts = max(1, s["batch"] // 2)
    G = cfg.group_size
    pool = tok.encode(" ".join(texts(spec, 40, 400)))
    prompts, completions, rewards = [], [], []
    for p in range(n_prompts):
        ids = tok.render_chat([{"role": "user", "content": f"def f{p}(x):"}], add_generation_prompt=True).ids
        for g in range(G):
            # long and short completions alike: packed, the short ones share rows
            n = int(torch.randint(4, cfg.max_new_tokens, (1,), generator=gen)) if g % 2 else \
                int(torch.randint(2, 10, (1,), generator=gen))
            at = int(torch.randint(0, len(pool) - n, (1,), generator=gen))
            prompts.append(list(ids))
            completions.append(list(pool[at: at + n - 1]) + [tok.im_end_id])
            rewards.append(float(g % 2) if g < 2 else float(torch.randint(0, 2, (1,), generator=gen)))
    rewards_t = torch.tensor(rewards, dtype=torch.float64)
    logps = [[0.0] * len(c) for c in completions]
    return build_batch(prompts, completions, logps, group_advantages(rewards_t, G), rewards_t, tok.pad_id,
                       packing=cfg.packing)


def make_objective(kind: str, spec: dict, tok, model, runtime):
    """(objective, batch on the device, a description) for one of pretrain, sft, dpo, rl."""
    from dataclasses import replace

    import torch

    from lmforge.train.objective import TokenObjective

    device = runtime.device
    if kind == "pretrain":
        b = pretrain_batch(spec, tok)
        return TokenObjective(), b.to(device), f"{tuple(b.tokens.shape)} rows, {segments(b)} segments"
    if kind == "sft":
        b = sft_batch(spec, tok)
        return TokenObjective(), b.to(device), (f"{tuple(b.tokens.shape)} rows, {segments(b)} segments, "
                                                f"{b.n_supervised} supervised")
    if kind == "dpo":
        from lmforge.config import DPOConfig
        from lmforge.train.dpo import DPOObjective, live_reference

        b = pair_batch(spec, tok)
        obj = DPOObjective(DPOConfig(), live_reference(model, runtime))
        return obj, b.to(device), f"{b.n_pairs} pairs in {b.tokens.shape[0]} rows of {b.tokens.shape[1]}"
    if kind == "rl":
        from lmforge.config import RLConfig
        from lmforge.scorers.rewards import Rewards
        from lmforge.train.rl import RLObjective, token_reference

        cfg = replace(RLConfig(), group_size=4, max_new_tokens=min(64, spec["shape"]["seq_len"] // 2), beta=0.04,
                      packing=True)
        b = rl_batch(spec, tok, cfg)
        obj = RLObjective(cfg, model, tok, [], [], Rewards(list(cfg.rewards)), runtime, 0,
                          reference=token_reference(model, runtime, cfg.temperature))
        rows = b.rows.tokens.shape if b.rows is not None else b.tokens.shape
        return obj, b.to(device), (f"{b.tokens.shape[0]} rollouts packed in {rows[0]} rows of {rows[1]}, "
                                   f"loss {cfg.loss_type}, beta {cfg.beta}")
    raise ValueError(f"unknown objective {kind!r}")


def segments(batch) -> int:
    """Attention segments over all rows of a Batch (padding counts as one)."""
    return int(sum(len(set(r.tolist())) for r in batch.document_ids))


def objective_grads(model, params_of, objective, batch, runtime) -> tuple[float, dict]:
    """One forward and backward of `objective.loss(model, batch) / count`, as `Trainer.train_step`
    does: (the summed loss, {parameter name: its gradient, float32})."""
    import torch

    params_of.zero_grad(set_to_none=True)
    model.train()
    with runtime.autocast():
        nats, _ = objective.loss(model, batch)
    (nats / max(float(objective.count(batch)), 1.0)).backward()
    grads = {n: p.grad.detach().float().clone() for n, p in params_of.named_parameters() if p.grad is not None}
    params_of.zero_grad(set_to_none=True)
    if runtime.device.type == "cuda":
        torch.cuda.synchronize()
    return float(nats.detach()), grads


# -- row 2: compiled against eager gradients -------------------------------------------------------
def worker_grads(spec: dict) -> dict:
    import torch

    from lmforge.runtime import Runtime
    from lmforge.tokenizer import Tokenizer

    device = device_setup(spec)
    kind = spec["objective"]
    precision = spec.get("precision", "bf16")
    tok = Tokenizer.load(spec["tokenizer"])
    model, backend = small_model(spec, tok, device)
    dtype = torch.bfloat16 if precision == "bf16" else None
    runtime, fp32 = Runtime(device, dtype), Runtime(device, None)
    objective, batch, what = make_objective(kind, spec, tok, model, runtime)
    t0 = time.perf_counter()
    loss_e, g_eager = objective_grads(model, model, objective, batch, runtime)
    floor = None
    if precision == "bf16":  # the same in fp32, its reference (DPO, RL's KL term) in fp32 too
        floor_objective, floor_batch, _ = make_objective(kind, spec, tok, model, fp32)
        floor = objective_grads(model, model, floor_objective, floor_batch, fp32)[1]
    eager_s = time.perf_counter() - t0
    compiled = torch.compile(model, backend=spec["compile_backend"])
    t0 = time.perf_counter()
    loss_c, g_comp = objective_grads(compiled, model, objective, batch, runtime)
    compile_s = time.perf_counter() - t0
    cmp = compare_grads(g_comp, g_eager, floor, GRAD_TOL[precision])
    loss_rel = abs(loss_c - loss_e) / max(abs(loss_e), 1e-30)
    if not math.isfinite(loss_c) or loss_rel > GRAD_TOL[precision]["norm"]:
        cmp["problems"].insert(0, f"loss compiled {loss_c:.6g} vs eager {loss_e:.6g} (rel diff {loss_rel:.1e})")
    ok = not cmp["problems"]
    cell = grads_cell(cmp, loss_rel)
    note = (f"{what}; {precision} autocast, attention {backend}, torch.compile(backend={spec['compile_backend']!r}) "
            f"first forward+backward {compile_s:.1f} s; per group norm diff/max rel err: {groups_note(cmp)}")
    return {"status": "PASS" if ok else "FAIL", "summary": cell if ok else cmp["problems"][0] + " | " + cell,
            "note": note, "figures": {"objective": kind, "precision": precision, "attention": backend,
                                      "batch": what, "loss_eager": loss_e, "loss_compiled": loss_c,
                                      "loss_rel_diff": loss_rel, "groups": {k: v for k, v in cmp.items()
                                                                            if k != "problems"},
                                      "problems": cmp["problems"], "compile_backend": spec["compile_backend"],
                                      "first_compiled_step_s": compile_s, "eager_s": eager_s,
                                      "tolerance": GRAD_TOL[precision]}}


# -- row 3: FlexAttention against sdpa ---------------------------------------------------------------
def random_document_ids(B: int, T: int, gen) -> "torch.Tensor":
    """(B, T) int32 packed segments of random lengths (8..T/2), ids counting up along each row."""
    import torch

    rows = []
    for _ in range(B):
        ids, d = [], 0
        while len(ids) < T:
            n = int(torch.randint(8, max(9, T // 2), (1,), generator=gen))
            ids += [d] * n
            d += 1
        rows.append(ids[:T])
    return torch.tensor(rows, dtype=torch.int32)


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm()) / max(float(b.norm()), 1e-30)


def worker_flex(spec: dict) -> dict:
    import torch

    from lmforge.model.attention import flex_attention, sdpa_attention
    from lmforge.runtime import Runtime
    from lmforge.tokenizer import Tokenizer

    device = device_setup(spec)
    backward = device.type == "cuda"  # FlexAttention has no backward pass on a CPU (torch 2.13)
    s = spec["shape"]
    gen = torch.Generator().manual_seed(0)
    B, H, KV, T, hd = s["batch"] // 2 or 1, s["n_heads"], s["n_kv_heads"], s["seq_len"], s["dim"] // s["n_heads"]
    ids = random_document_ids(B, T, gen).to(device)
    base = [torch.randn(B, h, T, hd, generator=gen) for h in (H, KV, KV)]
    w = torch.randn(B, H, T, hd, generator=gen).to(device)
    figures, problems, cells = {"attention": {}, "backward": backward}, [], []
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        outs, grads = {}, {}
        for backend, fn in (("flex", flex_attention), ("sdpa", sdpa_attention)):
            q, k, v = (x.to(device, dtype).requires_grad_(backward) for x in base)
            o = fn(q, k, v, ids)
            outs[backend] = o.detach().float()
            if backward:
                (o.float() * w).sum().backward()
                grads[backend] = {"dq": q.grad.float(), "dk": k.grad.float(), "dv": v.grad.float()}
        f = {"out": rel_l2(outs["flex"], outs["sdpa"])}
        if backward:
            f.update({g: rel_l2(grads["flex"][g], grads["sdpa"][g]) for g in ("dq", "dk", "dv")})
        tol = FLEX_TOL[name]
        figures["attention"][name] = {**f, "tol": tol}
        worst = max(f, key=f.get)
        cells.append(f"attn {name} max rel err {f[worst]:.1e} ({worst}; tol {tol:.0e})")
        if not all(math.isfinite(x) and x <= tol for x in f.values()):
            problems.append(f"attention {name}: " + ", ".join(f"{k} {x:.1e}" for k, x in f.items())
                            + f" (tol {tol:.0e})")
    # the whole model on packed SFT rows: flex against sdpa, bf16 autocast (sdpa fp32 as the floor)
    tok = Tokenizer.load(spec["tokenizer"])
    model, _ = small_model(spec, tok, device)
    from lmforge.train.objective import TokenObjective

    obj, bf16, fp32 = TokenObjective(), Runtime(device, torch.bfloat16), Runtime(device, None)
    batch = sft_batch(spec, tok).to(device)
    losses = {}
    if backward:
        model.set_attention("flex")
        losses["flex"], g_flex = objective_grads(model, model, obj, batch, bf16)
        model.set_attention("sdpa")
        losses["sdpa"], g_sdpa = objective_grads(model, model, obj, batch, bf16)
        g_floor = objective_grads(model, model, obj, batch, fp32)[1]
        cmp = compare_grads(g_flex, g_sdpa, g_floor, GRAD_TOL["bf16"])
        problems += [f"model: {p}" for p in cmp["problems"]]
        figures["model"] = {"groups": {k: v for k, v in cmp.items() if k != "problems"}}
        cells.append(f"model bf16 grads max rel err {cmp['all']['max_rel']:.1e}")
    else:
        with torch.no_grad():
            for backend in ("flex", "sdpa"):
                model.set_attention(backend)
                with bf16.autocast():
                    losses[backend] = float(obj.loss(model, batch)[0])
        cells.append("gradients n/a (no FlexAttention backward on a CPU)")
        figures["model"] = {}
    loss_rel = abs(losses["flex"] - losses["sdpa"]) / max(abs(losses["sdpa"]), 1e-30)
    figures["model"].update({"loss_flex": losses["flex"], "loss_sdpa": losses["sdpa"], "loss_rel_diff": loss_rel,
                             "batch_segments": segments(batch), "tol_loss": FLEX_TOL["model_loss"]})
    cells.insert(len(cells) - 1, f"model bf16 loss rel diff {loss_rel:.1e}")
    if not (math.isfinite(loss_rel) and loss_rel <= FLEX_TOL["model_loss"]):
        problems.append(f"model loss flex {losses['flex']:.6g} vs sdpa {losses['sdpa']:.6g}")
    note = (f"attention: B {B}, {H}/{KV} heads (GQA), T {T}, head_dim {hd}, up to {int(ids.max()) + 1} segments a "
            f"row; model: packed SFT rows {tuple(batch.tokens.shape)}, {segments(batch)} segments")
    if "groups" in figures["model"]:
        note += "; model groups norm diff/max rel err: " + groups_note(figures["model"]["groups"])
    ok = not problems
    return {"status": "PASS" if ok else "FAIL", "summary": "; ".join(cells) if ok else problems[0],
            "note": note, "figures": {**figures, "problems": problems}}


# -- row 4: the training step against transformers -------------------------------------------------
def matmul_rate(device, n: int, repeat: int = 5, calls: int = 20) -> list[float]:
    """FLOP/s samples of an n x n x n bf16 torch.mm (2 n^3 FLOPs; `calls` products between
    synchronisations on CUDA)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    calls = calls if device.type == "cuda" else 1

    def run() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    run()
    run()
    return [calls * 2 * n**3 / run() for _ in range(repeat)]


def random_stream(shape: dict, seed: int = 0, n_samples: int = 64):
    """A RowStream over random tokens, one full-length document a row (plain causal attention
    on both sides, as bench_train.py's)."""
    import numpy as np

    from lmforge.data.packing import RowStream

    T = shape["seq_len"]
    data = np.random.default_rng(seed).integers(0, shape["vocab"], size=(n_samples, T + 1), dtype=np.int64)
    return RowStream(np.full(n_samples, T), lambda s, a, b: data[s, a:b], None, T, shape["batch"], pad_id=0,
                     seed=seed)


def step_flops_per_token(model, shape: dict) -> dict:
    """Model FLOPs per token (module docstring): 6 N + 12 L d T, N the parameters in matrix products."""
    n_matmul = model.num_parameters(non_embedding=True) + shape["dim"] * shape["vocab"]  # + the output head
    attn = 12 * shape["n_layers"] * shape["dim"] * shape["seq_len"]
    return {"n_matmul_params": n_matmul, "attention_flops_per_token": attn,
            "flops_per_token": 6 * n_matmul + attn,
            "flops_per_token_without_head": 6 * model.num_parameters(non_embedding=True) + attn}


def worker_step(spec: dict) -> dict:
    import torch

    from lmforge.config import Config, ModelConfig
    from lmforge.model import Transformer
    from lmforge.runtime import autocast
    from lmforge.train.distributed import DistInfo
    from lmforge.train.trainer import Trainer

    device = device_setup(spec)
    s = spec["shape"]
    backend = spec["compile_backend"]
    work = Path(spec["workdir"])
    cfg = Config()
    # qk_norm off: the model LlamaForCausalLM holds (with QK-norm the exporter's twin is Qwen3's)
    cfg.model = ModelConfig(dim=s["dim"], n_layers=s["n_layers"], n_heads=s["n_heads"], n_kv_heads=s["n_kv_heads"],
                            vocab_size=s["vocab"], max_seq_len=s["seq_len"], attention="sdpa", qk_norm=False)
    cfg.data.seq_len = s["seq_len"]
    t = cfg.train
    t.micro_batch_size, t.grad_accum_steps, t.precision = s["batch"], 1, "bf16"
    t.lr, t.warmup_steps, t.steps, t.optimizer = 1e-3, 2, 1_000_000, "adamw"
    t.compile = backend == "inductor"  # lmforge's own train.compile path (torch.compile(model))
    cfg = cfg.validate()
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    model.reset_parameters(seed=0)
    contract = common.synthetic_contract(s["vocab"])
    try:  # transformers' best path: sdpa attention (its default where torch has it)
        twin = common.hf_twin(model, contract, use_cache=False, attn_implementation="sdpa")
    except TypeError:  # a transformers whose config does not take it as a keyword
        twin = common.hf_twin(model, contract, use_cache=False)
    hf_class, hf_attn = type(twin).__name__, getattr(twin.config, "_attn_implementation", "?")
    trainer = Trainer(cfg, work / "run", work, model, random_stream(s), dist=DistInfo(device=device), progress=False,
                      log=lambda m: print(m, file=sys.stderr))
    if not t.compile:  # --smoke: a compile backend that needs no C++ compiler
        trainer.model = torch.compile(trainer.model, backend=backend)
    twin.to(device).train()
    decay = [p for p in twin.parameters() if p.dim() >= 2]
    no_decay = [p for p in twin.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)
    hf_fwd = torch.compile(twin, backend=backend)
    stream = random_stream(s)

    def hf_step() -> float:
        b = stream.next_batch().to(device)
        with autocast(device, torch.bfloat16):
            out = hf_fwd(input_ids=b.tokens, labels=b.targets, shift_labels=b.targets)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(out.loss.detach())

    def lm_step() -> float:
        return trainer.train_step()["loss"]

    first, compile_s = {}, {}
    for side, fn in (("lmforge", lm_step), ("transformers", hf_step)):
        t0 = time.perf_counter()
        first[side] = fn()
        compile_s[side] = time.perf_counter() - t0
        print(f"step: {side} first step (compile) {compile_s[side]:.1f} s, loss {first[side]:.4f}", file=sys.stderr,
              flush=True)
    for _ in range(max(0, spec["warmup"] - 1)):
        lm_step()
        hf_step()
    # compiled and warm: wait until the rows beside this one are done, then time alone
    Path(spec["ready_file"]).write_text("ready")
    waited = time.perf_counter()
    while not Path(spec["go_file"]).exists():
        if os.getppid() != spec["parent_pid"]:  # the check that started this row is gone: so is its GPU plan
            raise RuntimeError("the gpu_check process that started this row ended before it said go")
        time.sleep(0.2)
    waited = time.perf_counter() - waited
    print(f"step: timing (waited {waited:.1f} s for the other rows)", file=sys.stderr, flush=True)
    peaks = matmul_rate(device, spec["matmul_n"])
    times = common.interleaved({"lmforge": lm_step, "transformers": hf_step}, 1, spec["repeat"])
    peaks += matmul_rate(device, spec["matmul_n"])
    peak = max(peaks)
    tokens = s["batch"] * s["seq_len"]
    fl = step_flops_per_token(trainer.raw_model, s)
    sides = {}
    for side in ("lmforge", "transformers"):
        tps = times[side].rate(tokens)
        sides[side] = {"tokens_per_s": tps.as_dict(), "step_s": times[side].as_dict(),
                       "mfu": tps.median * fl["flops_per_token"] / peak,
                       "mfu_without_head": tps.median * fl["flops_per_token_without_head"] / peak,
                       "first_step_s": compile_s[side], "first_loss": first[side]}
    ratio = sides["lmforge"]["tokens_per_s"]["median"] / sides["transformers"]["tokens_per_s"]["median"]
    diff = abs(first["lmforge"] - first["transformers"])
    problems = []
    if not all(math.isfinite(x) for x in first.values()):
        problems.append(f"non-finite first loss: {first}")
    elif diff > STEP_FIRST_LOSS_TOL:
        problems.append(f"first-step losses differ: lmforge {first['lmforge']:.4f}, transformers "
                        f"{first['transformers']:.4f} (|diff| {diff:.1e} > {STEP_FIRST_LOSS_TOL})")
    lm, hf = sides["lmforge"], sides["transformers"]
    cell = (f"{lm['tokens_per_s']['median']:,.0f} vs {hf['tokens_per_s']['median']:,.0f} tok/s ({ratio:.2f}x); "
            f"MFU {100 * lm['mfu']:.1f}% vs {100 * hf['mfu']:.1f}% of {fmt_flops(peak)} measured")
    note = (f"dim {s['dim']}, {s['n_layers']} layers, {s['n_heads']}/{s['n_kv_heads']} heads, vocab {s['vocab']}, "
            f"{s['batch']} x {s['seq_len']} tokens, bf16 autocast, AdamW; lmforge Trainer.train_step (attention "
            f"sdpa, qk_norm off, train.compile) vs transformers {hf_class} (attn_implementation {hf_attn!r}, "
            f"torch.compile(model)); compile backend {backend!r}; first step (the compile) "
            f"{compile_s['lmforge']:.0f} s "
            f"vs {compile_s['transformers']:.0f} s; first-step loss {first['lmforge']:.4f} vs "
            f"{first['transformers']:.4f}; median of {spec['repeat']} interleaved steps a side (min-max "
            f"{times['lmforge'].rate(tokens).spread()} vs {times['transformers'].rate(tokens).spread()} tok/s); "
            f"{fl['n_matmul_params']:,} params in matmuls, {fl['flops_per_token'] / 1e6:,.1f} MFLOP/token "
            f"(without the head: MFU {100 * lm['mfu_without_head']:.1f}% vs {100 * hf['mfu_without_head']:.1f}%); "
            f"bf16 matmul {spec['matmul_n']}^3 best {fmt_flops(peak)} (samples "
            f"{', '.join(fmt_flops(x) for x in peaks)})")
    return {"status": "FAIL" if problems else "PASS", "summary": problems[0] if problems else cell, "note": note,
            "figures": {"shape": s, "sides": sides, "ratio": ratio, "matmul_peak_flops": peak,
                        "matmul_samples": peaks, "flops": fl, "reference": hf_class, "hf_attn_implementation": hf_attn,
                        "compile_backend": backend, "waited_s": waited, "problems": problems}}


WORKERS = {"grads": worker_grads, "flex": worker_flex, "step": worker_step}


def worker_main(name: str, spec_path: str, result_path: str) -> int:
    """A row's process: run WORKERS[name] on the spec, write {"status", "summary", "note",
    "figures"} (or the error) to `result_path`."""
    spec = json.loads(Path(spec_path).read_text())
    try:
        res = WORKERS[name](spec)
    except BaseException as exc:  # the row's FAIL: its last line, the traceback in the log
        traceback.print_exc()
        res = {"status": "FAIL", "summary": f"{type(exc).__name__}: {last_line(str(exc)) or '(no message)'}",
               "figures": {}, "traceback": traceback.format_exc()[-4000:]}
    Path(result_path).write_text(json.dumps(res, default=str))
    return 0


# -- row 1: pytest ----------------------------------------------------------------------------------
def pytest_collection_modifyitems(config, items):  # a pytest hook: row 1 runs `pytest -p gpu_check`
    """Loaded as a pytest plugin, this module makes a test whose skip reason names CUDA a CUDA
    test (the `cuda` mark added, before `-m cuda` selects), whether or not its author marked it,
    and says which it selected that way."""
    import pytest

    reporter = config.pluginmanager.get_plugin("terminalreporter")
    for item in items:
        if item.get_closest_marker("cuda"):
            continue
        for m in item.iter_markers("skipif"):
            if "cuda" in str(m.kwargs.get("reason", "")).lower():
                item.add_marker(pytest.mark.cuda)
                if reporter is not None:
                    reporter.write_line(f"gpu_check: selected (no cuda mark): {item.nodeid}")
                break


if "pytest" in sys.modules:  # loaded by pytest (-p gpu_check): run before -m deselects
    pytest_collection_modifyitems = sys.modules["pytest"].hookimpl(tryfirst=True)(pytest_collection_modifyitems)


def cuda_test_files() -> list[str]:
    """The test files that hold CUDA tests (a `cuda` mark or a `torch.cuda.is_available()` skip),
    relative to the repository; ["tests/"] when none is found. Collecting only these keeps
    row 1 clear of test modules whose optional dependencies a GPU machine lacks."""
    import re

    found = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if re.search(r"mark\.cuda|cuda\.is_available\(\)", p.read_text(encoding="utf-8", errors="replace")))
    return found or ["tests/"]


def parse_pytest(out: str) -> dict:
    """Counts from pytest's last summary line, the failing and erroring ids, the skip reasons."""
    import re

    counts = {k: 0 for k in ("passed", "failed", "skipped", "errors", "deselected", "xfailed", "xpassed")}
    summary = next((x for x in reversed(out.splitlines()) if re.search(r"\b(passed|failed|skipped|deselected|error|"
                                                                       r"no tests ran)\b", x)), "")
    for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)", summary):
        counts["errors" if k.startswith("error") else k] += int(n)
    failing = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    skips = re.findall(r"^SKIPPED \[\d+\] (.*)$", out, re.M)
    unmarked = re.findall(r"^gpu_check: selected \(no cuda mark\): (\S+)", out, re.M)
    return {"counts": counts, "failing": failing, "skip_reasons": skips, "summary_line": summary.strip("= "),
            "selected_without_mark": sorted(set(unmarked))}


# -- orchestration ------------------------------------------------------------------------------------
class Task:
    """One row's process (start_new_session: a timeout kills its whole group, compile workers too)."""

    def __init__(self, row: str, argv: list[str], log: Path, timeout: float, env: dict, cwd: Path,
                 result: Path | None = None, finish=None):
        self.row, self.argv, self.log_path, self.timeout, self.env, self.cwd = row, argv, log, timeout, env, cwd
        self.result_path, self.finish = result, finish
        self.proc: subprocess.Popen | None = None
        self.started = self.ended = 0.0
        self.status: str | None = None

    def start(self) -> None:
        self.log = open(self.log_path, "wb")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env, cwd=self.cwd, start_new_session=True)

    def kill(self) -> None:
        import signal

        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                self.proc.kill()
            self.proc.wait()

    def poll(self) -> bool:
        """True once ended (by itself, or killed at its timeout)."""
        if self.proc is None or self.status is not None:
            return self.status is not None
        rc = self.proc.poll()
        if rc is None and time.perf_counter() - self.started > self.timeout:
            self.kill()
            self.status = f"timed out after {self.timeout:.0f} s"
        elif rc is not None:
            self.status = common.exit_status(rc)
        else:
            return False
        self.ended = time.perf_counter()
        self.log.close()
        return True

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def outcome(self) -> dict:
        """The row's result: the worker's, or `finish(self)`'s, or a FAIL naming how it ended."""
        seconds = round(self.ended - self.started, 1)
        log = self.log_text()
        try:
            if self.finish is not None:
                res = self.finish(self, log)
            elif self.result_path is not None and self.result_path.is_file():
                res = json.loads(self.result_path.read_text())
            else:
                tail = last_line(log)
                res = {"status": "FAIL", "summary": f"{self.status}" + (f": {tail}" if tail else ""), "figures": {}}
        except Exception as exc:  # reading a result must not end the check
            res = {"status": "FAIL", "summary": f"reading the result: {type(exc).__name__}: {last_line(str(exc))}",
                   "figures": {}}
        if self.status and self.status != "exit 0" and self.status not in res["summary"]:
            if res.get("status") == "FAIL":
                res["summary"] = f"{self.status}: {res['summary']}"
            else:  # its result came, then the process ended badly (a crash at CUDA teardown): say so
                res["summary"] += f" (then the process ended: {self.status})"
        res.update(row=self.row, seconds=seconds, exit=self.status)
        if res.get("status") == "FAIL":
            res["log_tail"] = "\n".join(log.strip().splitlines()[-25:])
        return res


def child_env(smoke: bool, compile_threads: int | None = None) -> dict:
    """The rows' environment: src/ and bench/ first on PYTHONPATH (relative entries made absolute:
    the rows run in their own folders), unbuffered output; on a CPU one torch thread a row."""
    paths = [str(ROOT / "src"), str(BENCH)]
    paths += [str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "PYTHONUNBUFFERED": "1"}
    if smoke:
        env["OMP_NUM_THREADS"] = "1"
    if compile_threads:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(compile_threads)
    return env


def gpu_compute_mode() -> str:
    """nvidia-smi's compute mode of GPU 0 ("Default", "Exclusive_Process", ...), or "" when unknown."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return ""
    try:
        out = subprocess.run([exe, "--query-gpu=compute_mode", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout
        return out.strip().splitlines()[0].strip() if out.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def write_json(path: Path | None, doc: dict) -> None:
    """The JSON report, replaced atomically (written again as each row ends: a check killed
    from outside still leaves the rows it finished)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


def finish_pytest(task: Task, log: str) -> dict:
    p = parse_pytest(log)
    c = p["counts"]
    ok = task.status == "exit 0" and c["passed"] > 0 and c["failed"] == 0 and c["errors"] == 0
    cell = f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped" + (
        f", {c['errors']} errors" if c["errors"] else "")
    if p["failing"]:
        cell += "; failing: " + ", ".join(p["failing"][:6]) + (" ..." if len(p["failing"]) > 6 else "")
    if task.status == "exit 5":
        cell = "no test selected (pytest exit 5)"
    elif task.status and task.status.startswith(("timed out", "crashed")):
        cell = f"{task.status}; so far: {cell}"
    note = f"pytest: {p['summary_line'] or last_line(log)}"
    if p["selected_without_mark"]:
        note += ("; CUDA tests without the `cuda` mark, selected by their skip reason: "
                 + ", ".join(p["selected_without_mark"]))
    if p["skip_reasons"]:
        note += "; skipped: " + " | ".join(p["skip_reasons"][:4])
    return {"status": "PASS" if ok else "FAIL", "summary": cell, "note": note, "figures": p}


def speedrun_finish(out: Path, max_bpb: float, budget: float):
    def finish(task: Task, log: str) -> dict:
        summary_path = out / "summary.json"
        if not summary_path.is_file():
            return {"status": "FAIL", "summary": f"{task.status}: {last_line(log) or 'no summary.json'}",
                    "figures": {}}
        s = json.loads(summary_path.read_text())
        st = s.get("stage_seconds", {})
        bpb = s.get("val_bits_per_byte")
        figures = {k: s.get(k) for k in ("val_bits_per_byte", "val_loss", "xz_bits_per_byte", "tokens_trained",
                                         "tokens_per_s", "train_seconds", "stage_seconds", "parameters",
                                         "pretrain_health", "sft_val_loss", "sft_parse_and_im_end_fraction",
                                         "sft_steps", "sft_train_seconds", "sft_health")}
        steps = None
        metrics = out / "pretrain" / "metrics.jsonl"
        if metrics.is_file():
            rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
            steps = rows[-1].get("step") if rows else None
        figures["pretrain_steps"] = steps
        figures["speedrun_wall_s"] = round(task.ended - task.started, 1)
        problems = []
        if task.status != "exit 0":
            problems.append(f"speedrun {task.status}: {last_line(log)}")
        if bpb is None or not math.isfinite(bpb) or bpb >= max_bpb:
            problems.append(f"held-out bits per byte {bpb} (expected < {max_bpb:g}: a model that trained)")
        cell = (f"pretrain val {bpb:.4f} bits/byte (xz {s.get('xz_bits_per_byte', float('nan')):.2f}); pretrain stage "
                f"{st.get('pretrain', float('nan')):.0f} s of train.time_budget_s {budget:g} ({steps} steps, "
                f"{s.get('tokens_per_s', 0):,.0f} tok/s); "
                f"speedrun {figures['speedrun_wall_s']:.0f} s")
        note = ("speedrun stages: " + ", ".join(f"{k} {v:.0f} s" for k, v in st.items())
                + f"; health {s.get('pretrain_health', '-')}; SFT val loss {fmt(s.get('sft_val_loss'), '.4f')}, "
                  f"bodies that parse {fmt(s.get('sft_parse_and_im_end_fraction'), '.0%')}")
        return {"status": "FAIL" if problems else "PASS", "summary": problems[0] + " | " + cell if problems else cell,
                "note": note, "figures": figures}

    return finish


def build_tasks(args, rows: list[str], work: Path, tokenizer: Path | None) -> dict[str, Task]:
    smoke = args.smoke
    shapes = SMOKE_SHAPES if smoke else GPU_SHAPES
    device = "cpu" if smoke else "cuda"
    backend = args.compile_backend or ("aot_eager" if smoke else "inductor")
    jobs = max(1, args.jobs)
    # rows 1-3 side by side: inductor's compile workers shared out; row 4 compiles with them all
    threads = None if smoke else max(2, (common.cores() or 16) // jobs)
    tasks: dict[str, Task] = {}
    me = [sys.executable, str(Path(__file__).resolve())]

    def timeout(row: str) -> float:
        return float(SMOKE_TIMEOUT if smoke else TIMEOUT[row])

    for row in rows:
        folder = work / row
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / "log.txt"
        if row == "pytest":
            argv = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-p", "gpu_check",
                    "--continue-on-collection-errors", "-m", "cuda", *cuda_test_files()]
            tasks[row] = Task(row, argv, log, timeout(row), child_env(smoke), ROOT, finish=finish_pytest)
            continue
        if row == "speedrun":
            out = folder / "speedrun"
            argv = [sys.executable, "-m", "lmforge", "speedrun", "--out", str(out), "--no-progress",
                    "--set", f"train.time_budget_s={args.speedrun_budget:g}"]
            config = ROOT / "configs" / "stdlib-tiny.toml"
            if config.is_file():
                argv[4:4] = ["--config", str(config)]
            if smoke:
                corpus = common.smoke_corpus(folder / "corpus")
                argv += [x for kv in [f"data.source={corpus}", *SMOKE_SPEEDRUN_SETS] for x in ("--set", kv)]
            max_bpb = math.inf if smoke else args.speedrun_max_bpb
            tasks[row] = Task(row, argv, log, timeout(row), child_env(smoke), folder,
                              finish=speedrun_finish(out, max_bpb, args.speedrun_budget))
            continue
        spec = {"device": device, "smoke": smoke, "compile_backend": backend, "tokenizer": str(tokenizer),
                "workdir": str(folder)}
        if row.startswith("grads-"):
            name = "grads"
            spec.update(objective=row.split("-", 1)[1], shape=shapes["small"], precision=args.grad_precision)
        elif row == "flex":
            name = "flex"
            spec.update(shape=shapes["small"])
        else:  # step
            name = "step"
            # --smoke: dynamo alone (row 2 runs AOTAutograd already; this row's own code is the point)
            spec.update(compile_backend="eager" if smoke and not args.compile_backend else backend,
                        shape=shapes["step"], warmup=2 if smoke else 3, repeat=2 if smoke else 10,
                        matmul_n=256 if smoke else 8192, ready_file=str(folder / "ready"), go_file=str(work / "go"),
                        parent_pid=os.getpid())
        (folder / "spec.json").write_text(json.dumps(spec))
        argv = me + ["--worker", name, "--spec", str(folder / "spec.json"), "--result", str(folder / "result.json")]
        env = child_env(smoke, threads if row in PARALLEL else None)
        tasks[row] = Task(row, argv, log, timeout(row), env, folder, result=folder / "result.json")
    return tasks


def render(results: dict[str, dict], rows: list[str], smoke: bool, header: dict) -> str:
    body = []
    for row in rows:
        r = results.get(row)
        if r is None:
            body.append((NUMBER[row], TITLE[row], "FAIL", "not run", "-"))
            continue
        body.append((NUMBER[row], TITLE[row], r["status"], str(r.get("summary", "")).replace("|", "/"),
                     f"{r.get('seconds', 0):.0f}"))
    title = "GPU check: " + header.get("device", "?") + (" (SMOKE RUN on a CPU: figures mean nothing)" if smoke else "")
    text = common.table(["#", "check", "result", "figures", "s"], body, title=title)
    notes = [f"{header.get('machine_line', '')}; {header.get('seconds', 0):.0f} s in all; "
             f"{header.get('failed', 0)} of {len(rows)} rows failed."]
    notes.append("Tolerances: compiled vs eager per parameter group, bf16: grad-norm rel diff <= "
                 f"{GRAD_TOL['bf16']['norm']:g}, max rel err of a tensor <= max({GRAD_TOL['bf16']['tensor']:g}, "
                 f"{GRAD_TOL['bf16']['floor_factor']:g} x eager bf16 vs eager fp32) "
                 f"(fp32: {GRAD_TOL['fp32']['norm']:g} "
                 f"/ {GRAD_TOL['fp32']['tensor']:g}); flex vs sdpa: rel L2 <= {FLEX_TOL['fp32']:g} fp32, "
                 f"{FLEX_TOL['bf16']:g} bf16, model loss <= {FLEX_TOL['model_loss']:g}; speedrun bits/byte < "
                 f"{SPEEDRUN_MAX_BPB:g}; step: first-step losses within {STEP_FIRST_LOSS_TOL:g}.")
    notes.append("MFU = tokens/s x (6 N + 12 L d T) / measured bf16 matmul peak; N = parameters in matrix "
                 "products (non-embedding + output head); PaLM (arXiv 2204.02311) appendix B, nanoGPT estimate_mfu.")
    for row in rows:
        r = results.get(row) or {}
        if r.get("note"):
            notes.append(f"{NUMBER[row]} {row}: {r['note']}")
    for row in rows:
        r = results.get(row) or {}
        if r.get("status") == "FAIL" and r.get("log_tail"):
            notes.append(f"{NUMBER[row]} {row} FAILED; the end of its log:\n\n    "
                         + "\n    ".join(r["log_tail"].splitlines()[-15:]))
    return text + "\n\n" + "\n".join(f"- {n}" for n in notes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="write every figure here as JSON (updated as rows end)")
    ap.add_argument("--only", default="all", help="rows to run: " + ", ".join(ROWS) + ", grads (2a-2d), all; "
                                                  "pretrain, sft, dpo, rl for one grads row; or their numbers")
    ap.add_argument("--jobs", type=int, default=0,
                    help="rows 1-3 run this many at a time beside row 4's compile (default 4; --smoke 3; "
                         "1: everything one after another, e.g. on a GPU in exclusive-process mode)")
    ap.add_argument("--deadline", type=float, default=470.0,
                    help="seconds for the whole check (0 = none): later rows keep what they need, a row not "
                         "started in time is a FAIL")
    ap.add_argument("--logs", type=Path, default=None, help="copy every row's log (and the speedrun's summary) here")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend of rows 2 and 4 (default inductor; --smoke: aot_eager)")
    ap.add_argument("--grad-precision", default="bf16", choices=("bf16", "fp32"), help="row 2's autocast")
    ap.add_argument("--speedrun-budget", type=float, default=None,
                    help="row 5's train.time_budget_s (default 60; --smoke: 3)")
    ap.add_argument("--speedrun-max-bpb", type=float, default=SPEEDRUN_MAX_BPB)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    common.smoke_flag(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.spec, args.result)
    rows = expand_only(args.only)
    if args.jobs <= 0:
        args.jobs = 3 if args.smoke else 4
    if args.speedrun_budget is None:
        args.speedrun_budget = 3.0 if args.smoke else 60.0
    # --smoke: no CUDA tests to run; the speedrun only when named (its evaluation suite alone takes
    # 30-50 s of a 2-core CPU: `--smoke --only speedrun` runs a tiny one)
    skipped = {"pytest": "skipped (smoke)", "speedrun": "skipped (smoke; --smoke --only speedrun runs a tiny one)"}
    if not args.smoke:
        skipped = {}
    elif any(n.strip() in ("speedrun", "5") for n in args.only.split(",")):
        del skipped["speedrun"]
    rows_run = [r for r in rows if r not in skipped]
    import signal

    def terminated(signum, frame):  # SIGTERM: end the rows (their own sessions) and print what there is
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, terminated)
    t_start = time.perf_counter()
    deadline = t_start + (args.deadline if args.deadline > 0 else 1e9) + (300 if args.smoke else 0)
    import torch

    header = {"check": "gpu_check", "smoke": args.smoke, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "argv": sys.argv[1:] if argv is None else argv, "torch": torch.__version__}
    results: dict[str, dict] = {}

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:5.0f} s] {msg}", file=sys.stderr, flush=True)

    def save() -> None:
        write_json(args.json, {**header, "seconds": round(time.perf_counter() - t_start, 1),
                               "rows": [results[r] for r in rows if r in results],
                               "tolerances": {"grads": GRAD_TOL, "flex": FLEX_TOL, "speedrun_max_bpb":
                                              args.speedrun_max_bpb, "step_first_loss": STEP_FIRST_LOSS_TOL},
                               "failed": [r for r in rows if results.get(r, {}).get("status") == "FAIL"]})

    for r in rows:
        if r in skipped:
            results[r] = {"row": r, "status": "SKIP", "summary": skipped[r], "seconds": 0.0, "figures": {}}
    has_cuda = torch.cuda.is_available()
    header["device"] = torch.cuda.get_device_name(0) if has_cuda else "CPU"
    header["cuda"] = torch.version.cuda
    try:
        header["machine"] = common.machine()
        header["machine_line"] = common.machine_line(header["machine"])
    except Exception as exc:  # the description is not worth a failed check
        header["machine_line"] = f"(machine: {exc})"
    if not args.smoke:
        mode = gpu_compute_mode()
        header["compute_mode"] = mode
        if mode and mode != "Default" and args.jobs > 1:
            say(f"GPU compute mode {mode}: one row at a time (--jobs 1)")
            args.jobs = 1
    if not args.smoke and not has_cuda:
        for r in rows_run:
            results[r] = {"row": r, "status": "FAIL", "summary": "no CUDA device (torch.cuda.is_available() is False; "
                          "--smoke runs the CPU version)", "seconds": 0.0, "figures": {}}
        rows_run = []

    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    tasks: dict[str, Task] = {}
    try:
        tokenizer = None
        if any(r.startswith("grads-") or r == "flex" for r in rows_run):
            t0 = time.perf_counter()
            vocab = (SMOKE_SHAPES if args.smoke else GPU_SHAPES)["small"]["vocab"]
            tokenizer = work / "tokenizer"
            from lmforge.tokenizer import train_tokenizer

            train_tokenizer(common.smoke_texts(120, 2000), vocab, tokenizer, show_progress=False)
            say(f"tokenizer of {vocab} for rows 2-3 trained in {time.perf_counter() - t0:.1f} s")
        tasks = build_tasks(args, rows_run, work, tokenizer)
        parallel = [tasks[r] for r in rows_run if r in PARALLEL]
        step = tasks.get("step")
        speedrun = tasks.get("speedrun")
        go = work / "go"
        reserve_after_parallel = (RESERVE["speedrun"] if speedrun else 0) + (RESERVE["step"] if step else 0)

        def launch(task: Task, reserve: float) -> bool:
            left = deadline - reserve - time.perf_counter()
            if left < 20:
                results[task.row] = {"row": task.row, "status": "FAIL", "seconds": 0.0, "figures": {},
                                     "summary": f"not started: {args.deadline:g} s deadline (--deadline)"}
                save()
                return False
            task.timeout = min(task.timeout, left)
            task.start()
            say(f"{task.row}: started (time limit {task.timeout:.0f} s)")
            return True

        def collect(task: Task) -> None:
            results[task.row] = task.outcome()
            r = results[task.row]
            say(f"{task.row}: {r['status']} in {r['seconds']:.0f} s: {r['summary']}")
            save()

        running: list[Task] = []
        queue = list(parallel)
        ready_said = False
        if step is not None and args.jobs > 1:  # it compiles beside rows 1-3, then waits for `go`
            launch(step, RESERVE["speedrun"] if speedrun else 0)
        while queue or running:
            while queue and len(running) < args.jobs:
                t = queue.pop(0)
                if launch(t, reserve_after_parallel):
                    running.append(t)
            for t in list(running):
                if t.poll():
                    running.remove(t)
                    collect(t)
            if step is not None and step.proc is not None and step.status is None:
                if step.poll():
                    say(f"step: ended early ({step.status})")
                elif not ready_said and (work / "step" / "ready").exists():
                    ready_said = True
                    say("step: compiled and warm, waiting for rows 1-3 to end")
            time.sleep(0.2)
        go.write_text("go")
        if step is not None:
            if step.proc is None and step.row not in results:
                launch(step, RESERVE["speedrun"] if speedrun else 0)
            if step.proc is not None:
                if step.status is None:
                    say("step: rows 1-3 done, timing alone")
                while not step.poll():
                    time.sleep(0.2)
                collect(step)
        if speedrun is not None and launch(speedrun, 0):
            while not speedrun.poll():
                time.sleep(0.5)
            collect(speedrun)
    except BaseException as exc:  # Ctrl-C, or a bug here: end the rows, still print what there is
        for t in tasks.values():
            t.kill()
        for r in rows:
            results.setdefault(r, {"row": r, "status": "FAIL", "seconds": 0.0, "figures": {},
                                   "summary": f"not finished: {type(exc).__name__}: {last_line(str(exc))}"})
        if not isinstance(exc, (KeyboardInterrupt, Exception)):
            raise
        traceback.print_exc()
    finally:
        for t in tasks.values():
            t.kill()
        if args.logs is not None:
            args.logs.mkdir(parents=True, exist_ok=True)
            for row, t in tasks.items():
                if t.log_path.is_file():
                    shutil.copy(t.log_path, args.logs / f"{row}.log")
            summary = work / "speedrun" / "speedrun" / "summary.md"
            if summary.is_file():
                shutil.copy(summary, args.logs / "speedrun-summary.md")
        shutil.rmtree(work, ignore_errors=True)
    header["failed"] = sum(results.get(r, {}).get("status", "FAIL") == "FAIL" for r in rows)
    header["seconds"] = round(time.perf_counter() - t_start, 1)
    for r in rows:
        results.setdefault(r, {"row": r, "status": "FAIL", "summary": "not run", "seconds": 0.0, "figures": {}})
    save()
    print(render(results, rows, args.smoke, header), flush=True)
    return 1 if header["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
