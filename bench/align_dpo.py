"""bench_align.py's DPO arms (`lmforge dpo` with LoRA, TRL's `DPOTrainer` with PEFT) and what both
kinds of arm share: the stage's defaults (`stage_hyper`), TRL's scheduler for them (`trl_schedule`),
an `lmforge` run read back from its metrics (`lmforge_rows`), and a clock of TRL's steps (`StepClock`).

Not a benchmark itself (bench_align.py is): run_all.py and the smoke test take only bench_*.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from bench_finetune import HF_TARGETS, LORA_ALPHA, LORA_RANK, RECOMPUTE

#: lmforge's DPO loss both sides run (dpo.loss's default; TRL's loss_type)
DPO_LOSS = "sigmoid"


def stage_hyper(stage: str) -> dict:
    """lmforge's defaults of `stage` ("dpo" or "rl") and of [train] that its run applies: lr,
    warm-up steps, schedule, AdamW's betas / weight decay / clip, min_lr_ratio, decay_fraction,
    and the stage's own section (`section`), read from its config (so both sides get what lmforge runs)."""
    from lmforge.config import Config

    cfg = Config()
    s, t = getattr(cfg, stage), cfg.train
    return {"lr": s.lr, "warmup": s.warmup_steps, "schedule": s.schedule, "optimizer": s.optimizer,
            "beta1": t.beta1, "beta2": t.beta2, "weight_decay": t.weight_decay, "clip": t.grad_clip,
            "min_lr_ratio": t.min_lr_ratio, "decay_fraction": t.decay_fraction, "section": s}


def trl_schedule(h: dict, steps: int) -> dict:
    """transformers' `lr_scheduler_type` (and kwargs) for lmforge's schedule `h["schedule"]`.

    Raises:
        SystemExit: a schedule without a transformers twin."""
    if h["schedule"] == "constant":
        return {"lr_scheduler_type": "constant_with_warmup" if h["warmup"] else "constant"}
    if h["schedule"] == "cosine":
        if h["min_lr_ratio"] > 0:
            return {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": h["min_lr_ratio"]}}
        return {"lr_scheduler_type": "cosine"}
    if h["schedule"] == "wsd":
        from bench_finetune import wsd_kwargs

        return {"lr_scheduler_type": "warmup_stable_decay", "lr_scheduler_kwargs": wsd_kwargs(h, steps)}
    raise SystemExit(f"no transformers scheduler for lmforge's schedule {h['schedule']!r}")


def trl_common(a, h: dict, out: Path) -> dict:
    """The TrainingArguments both TRL arms share: lmforge's AdamW settings, schedule, precision
    (`resolve_precision("auto", cpu)`: bf16 autocast where the CPU has bf16 units), steps, seed;
    a step logged every step, nothing saved. TRL's own defaults otherwise (activation checkpointing on)."""
    import torch

    from lmforge.runtime import resolve_precision

    bf16 = resolve_precision("auto", torch.device("cpu")) == torch.bfloat16
    return dict(output_dir=str(out), gradient_accumulation_steps=1, max_steps=a.steps, learning_rate=h["lr"],
                warmup_steps=h["warmup"], adam_beta1=h["beta1"], adam_beta2=h["beta2"],
                weight_decay=h["weight_decay"], max_grad_norm=h["clip"], optim="adamw_torch", bf16=bf16,
                use_cpu=True, logging_steps=1, save_strategy="no", report_to=[], seed=a.seed,
                dataloader_num_workers=0, disable_tqdm=True, **trl_schedule(h, a.steps))


def peft_lora():
    """PEFT's LoRA as lmforge's `--set lora.rank=16`: rank 16, alpha 16, no dropout, every linear layer of the blocks."""
    from peft import LoraConfig

    return LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=HF_TARGETS,
                      task_type="CAUSAL_LM")


def lmforge_rows(work: Path, stage: str, sets: dict) -> list[dict]:
    """`lmforge STAGE --out RUN --no-progress --set k=v ...` in this process; its metrics.jsonl rows.

    Raises:
        SystemExit: the command failed."""
    from lmforge.cli import main as cli

    out = work / f"lmforge-{stage}-{os.getpid()}"  # a fresh run folder for every round
    argv = [stage, "--out", str(out), "--no-progress"]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    code = cli(argv)
    if code:
        raise SystemExit(f"lmforge {stage} exited {code}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def step_seconds(rows: list[dict]) -> list[float]:
    """Each optimizer step's own seconds from lmforge's metrics (`elapsed_s` sums the steps only:
    validation and checkpoints are left out)."""
    ends = [r["elapsed_s"] for r in rows if "elapsed_s" in r]
    return [b - a for a, b in zip([0.0] + ends[:-1], ends)]


def make_clock():
    """A transformers callback timing each optimizer step (seconds, `marks`) and keeping every
    logged dict (`logs`: TRL logs each step's loss and figures with logging_steps=1)."""
    import transformers

    class StepClock(transformers.TrainerCallback):
        def __init__(self):
            self.marks: list[float] = []
            self.logs: list[dict] = []

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.marks.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "train_runtime" not in logs:  # the run's summary is no step
                self.logs.append(dict(logs))

    return StepClock()


# -- the data ------------------------------------------------------------------------------------------
def prepare_dpo(work: Path, a) -> None:
    """lmforge's embedded preference pairs (`stdlib_preference_pairs` with dpo's defaults, the run's
    seed) written once as TRL's explicit conversational records (work/pairs.jsonl: lmforge's
    dpo.data); then the training pairs lmforge's stage takes from that file (`load_pairs`: split by
    the prompt's hash) in the order its `PairStream` deals them, a step's pairs after another, as
    TRL's dataset (work/trl_pairs.jsonl, read in order), and each step's real tokens (both sides
    of its pairs, rendered with the imported tokenizer: work/dpo_tokens.json)."""
    from lmforge.config import Config, apply_overrides
    from lmforge.data.preferences import PairStream, render_pairs
    from lmforge.data.stdlib_pairs import stdlib_preference_pairs
    from lmforge.stages.dpo import load_pairs
    from lmforge.tokenizer import Tokenizer

    cfg = Config()
    records = stdlib_preference_pairs(cfg.data.val_fraction, seed=a.seed, max_train=cfg.dpo.max_examples,
                                      max_chars=cfg.dpo.max_chars, include_tests=cfg.data.include_tests)["train"]
    path = work / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    run_cfg = apply_overrides(cfg, [f"dpo.data={path}", f"train.seed={a.seed}", f"dpo.val_examples={a.val}"])
    pairs, _ = load_pairs(run_cfg)
    tok = Tokenizer.load(work / "imported")
    samples = render_pairs(pairs["train"], tok, a.seq_len)
    stream = PairStream(samples, a.seq_len, a.pairs, tok.pad_id, a.seed, packing=run_cfg.dpo.packing)
    by_name = {r["name"]: r for r in records}
    rows, tokens = [], []
    for _ in range(a.steps):
        index = stream.next_batch().pair_index.tolist()
        rows += [{k: by_name[samples.names[i]][k] for k in ("prompt", "chosen", "rejected")} for i in index]
        tokens.append(sum(len(samples.ids[side][i]) for side in ("chosen", "rejected") for i in index))
    (work / "trl_pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "dpo_tokens.json").write_text(json.dumps(tokens))


def summary(seconds: list[float], tokens: list[float], warmup: int) -> dict:
    """s/step (the mean over the steps after `warmup`: their summed time over their count) and
    tokens/s (their tokens over their time)."""
    t, n = seconds[warmup:], tokens[warmup:]
    if not t:
        raise SystemExit(f"no step after the {warmup} warm-up steps: raise --steps")
    return {"s_per_step": sum(t) / len(t), "tokens_per_s": sum(n) / sum(t), "steps": len(seconds)}


# -- the arms ------------------------------------------------------------------------------------------
def run_lmforge_dpo(work: Path, a) -> dict:
    """`lmforge dpo` on the imported folder with LoRA rank 16: only the run's own keys set."""
    sets = {"dpo.init": work / "imported", "tokenizer.dir": work / "imported", "dpo.data": work / "pairs.jsonl",
            "data.seq_len": a.seq_len, "dpo.micro_batch_size": a.pairs, "dpo.steps": a.steps,
            "dpo.val_examples": a.val, "train.checkpoint_every": 0, "train.seed": a.seed, "lora.rank": LORA_RANK}
    if a.arm.endswith("-ac"):  # lmforge with activation checkpointing, as TRL's DPOConfig comes
        sets.update(RECOMPUTE)
    rows = [r for r in lmforge_rows(work, "dpo", sets) if "loss" in r]
    tokens = json.loads((work / "dpo_tokens.json").read_text())
    res = summary(step_seconds(rows), tokens, a.warmup)
    res.update(first_loss=rows[0]["loss"], last_loss=rows[-1]["loss"], first_logp_chosen=rows[0]["logps/chosen"])
    return res


def run_trl_dpo(work: Path, a) -> dict:
    """TRL's `DPOTrainer` + PEFT LoRA on the user's folder, the same pairs in the same order (a
    sequential sampler over lmforge's order), lmforge's dpo settings; TRL's defaults otherwise."""
    import torch
    import transformers
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    h = stage_hyper("dpo")
    if h["optimizer"] != "adamw":
        raise SystemExit(f"dpo.optimizer = {h['optimizer']!r}: TRL's arm runs AdamW")
    rows = [json.loads(line) for line in (work / "trl_pairs.jsonl").read_text().splitlines()]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(work / "user"), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(work / "user"))
    args = DPOConfig(**trl_common(a, h, work / f"trl-dpo-{os.getpid()}"), per_device_train_batch_size=a.pairs,
                     max_length=a.seq_len, truncation_mode="keep_start", beta=h["section"].beta, loss_type=[DPO_LOSS],
                     precompute_ref_log_probs=False, train_sampling_strategy="sequential")
    clock = make_clock()
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                         peft_config=peft_lora(), callbacks=[clock])
    trainer.train()
    logs = [x for x in clock.logs if "loss" in x]
    tokens = json.loads((work / "dpo_tokens.json").read_text())
    res = summary(clock.marks, tokens, a.warmup)
    res.update(first_loss=logs[0]["loss"], last_loss=logs[-1]["loss"], first_logp_chosen=logs[0]["logps/chosen"])
    return res
