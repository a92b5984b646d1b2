"""bench_align.py's RL arms: `lmforge rl` with LoRA on its standard-library prompts and its default
reward ("static"), and TRL's `GRPOTrainer` with PEFT on the same prompts in the same order, scored by
the same reward (`lmforge.scorers.rewards.REWARDS`, called with TRL's convention).

Not a benchmark itself (bench_align.py is): run_all.py and the smoke test take only bench_*.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from align_dpo import lmforge_rows, make_clock, peft_lora, stage_hyper, step_seconds, summary, trl_common
from bench_finetune import LORA_RANK, RECOMPUTE


def prepare_rl(work: Path, a) -> None:
    """The prompts `lmforge rl` trains on with rl.data = "stdlib" (`load_prompts`, those that fit a
    row beside the token budget: `render_prompts`), in the order its `PromptStream` deals them, a
    step's prompts after another, written as TRL's conversational prompt records with their fields
    (work/trl_prompts.jsonl: {"prompt": [messages], "signature", "module", ...}; lmforge's rl.data
    reads this form too), and each step's prompt tokens x group size (work/rl_prompt_tokens.json)."""
    from lmforge.config import Config, apply_overrides
    from lmforge.data.prompts import PromptStream
    from lmforge.stages.rl import load_prompts, render_prompts
    from lmforge.tokenizer import Tokenizer

    cfg = apply_overrides(Config(), [f"train.seed={a.seed}", f"rl.val_examples={a.val}"])
    prompts, _ = load_prompts(cfg)
    tok = Tokenizer.load(work / "imported")
    train, ids, _ = render_prompts(prompts["train"], tok, a.seq_len - a.new_tokens, False)
    stream = PromptStream(len(train), a.prompts, a.seed)
    rows, tokens = [], []
    for _ in range(a.steps):
        index = stream.next_batch().indices
        rows += [{"prompt": train[i].messages, **train[i].fields} for i in index]
        tokens.append(a.group * sum(len(ids[i]) for i in index))
    (work / "trl_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "rl_prompt_tokens.json").write_text(json.dumps(tokens))


def lmforge_static(stop_ids: list[int]):
    """lmforge's "static" reward as a TRL reward function f(completions, prompts, completion_ids,
    **the records' fields) -> [float]: a completion stopped where its last id is one of `stop_ids`
    (lmforge's: <|im_end|>, <|endoftext|>; a completion cut off by the budget scores 0, as lmforge's)."""
    from lmforge.scorers.rewards import REWARDS

    def static(completions, prompts, completion_ids, signature, module=None, **fields):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        stopped = [bool(ids) and ids[-1] in stop_ids for ids in completion_ids]
        scores = REWARDS["static"].function(completions=texts, prompts=prompts, signature=signature,
                                            stopped=stopped, module=module)
        return [s if stop else 0.0 for s, stop in zip(scores, stopped)]

    return static


def rollout_tokens(prompt_tokens: list[int], rows: int, mean_lengths: list[float]) -> list[float]:
    """Each step's tokens: its prompts' (x group size) plus its sampled completions' (rows x mean length)."""
    return [p + rows * m for p, m in zip(prompt_tokens, mean_lengths)]


def run_lmforge_rl(work: Path, a) -> dict:
    """`lmforge rl` on the imported folder with LoRA rank 16, its default prompts and reward: only
    the run's own keys set (and the rollout's shape in a smoke run)."""
    sets = {"rl.init": work / "imported", "tokenizer.dir": work / "imported", "data.seq_len": a.seq_len,
            "rl.micro_batch_size": a.prompts, "rl.steps": a.steps, "rl.val_examples": a.val,
            "train.checkpoint_every": 0, "train.seed": a.seed, "lora.rank": LORA_RANK}
    h = stage_hyper("rl")["section"]
    if (a.group, a.new_tokens) != (h.group_size, h.max_new_tokens):  # only --smoke changes them
        sets.update({"rl.group_size": a.group, "rl.max_new_tokens": a.new_tokens})
    if a.arm.endswith("-ac"):  # lmforge with activation checkpointing, as TRL's GRPOConfig comes
        sets.update(RECOMPUTE)
    rows = [r for r in lmforge_rows(work, "rl", sets) if "loss" in r]
    prompt_tokens = json.loads((work / "rl_prompt_tokens.json").read_text())
    tokens = rollout_tokens(prompt_tokens, a.prompts * a.group, [r["completions/mean_length"] for r in rows])
    res = summary(step_seconds(rows), tokens, a.warmup)
    res.update(reward=sum(r["reward"] for r in rows) / len(rows),
               mean_length=sum(r["completions/mean_length"] for r in rows) / len(rows))
    return res


def run_trl_grpo(work: Path, a) -> dict:
    """TRL's `GRPOTrainer` + PEFT LoRA: the same prompts in the same order (no shuffle), group size,
    prompts a step (one generation batch = one optimizer step, `num_iterations` 1: on policy),
    budget, temperature (no top-k / top-p), stop ids, lr and constant schedule, AdamW settings,
    precision; Dr. GRPO's loss and advantages (no division by the group's spread), no KL term, no vLLM."""
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    h = stage_hyper("rl")
    rl = h["section"]
    if h["optimizer"] != "adamw" or rl.beta != 0 or rl.loss_type != "dr_grpo":
        raise SystemExit(f"rl defaults changed ({h['optimizer']}, beta {rl.beta}, {rl.loss_type}): update TRL's arm")
    rows = [json.loads(line) for line in (work / "trl_prompts.jsonl").read_text().splitlines()]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(work / "user"), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(work / "user"))
    stop_ids = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    model.generation_config.eos_token_id = stop_ids  # lmforge stops at either
    batch = a.prompts * a.group
    args = GRPOConfig(**trl_common(a, h, work / f"trl-grpo-{os.getpid()}"), per_device_train_batch_size=batch,
                      num_generations=a.group, generation_batch_size=batch, num_iterations=1,
                      max_completion_length=a.new_tokens, temperature=rl.temperature, top_p=1.0, top_k=0,
                      repetition_penalty=1.0, beta=0.0, loss_type="dr_grpo", scale_rewards="none",
                      mask_truncated_completions=False, shuffle_dataset=False, use_vllm=False, log_completions=False)
    clock = make_clock()
    trainer = GRPOTrainer(model=model, reward_funcs=[lmforge_static(stop_ids)], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tok, peft_config=peft_lora(),
                          callbacks=[clock])
    trainer.train()
    logs = [x for x in clock.logs if "reward" in x]
    prompt_tokens = json.loads((work / "rl_prompt_tokens.json").read_text())
    tokens = rollout_tokens(prompt_tokens, batch, [x["completions/mean_length"] for x in logs])
    res = summary(clock.marks, tokens, a.warmup)
    res.update(reward=sum(x["reward"] for x in logs) / len(logs),
               mean_length=sum(x["completions/mean_length"] for x in logs) / len(logs))
    return res
