"""`lmforge rl`: reinforcement learning with verifiable rewards (a group-relative policy gradient).

RL is prompts, rewards and a loss, not a second trainer: `rl_stage` loads the model from
`rl.init` (usually an SFT run), reads prompts (lmforge.data.prompts; `rl.data = "stdlib"`: the
SFT task's standard-library functions whose reference passes the static check), renders them with
the chat template and the generation prompt, and runs the same `Trainer.fit` as every other stage
with `lmforge.train.rl.RLObjective`, which samples its own batches (the rollouts) and scores them
(`rl.rewards`, lmforge.scorers.rewards; generated code runs in lmforge.sandbox). The [rl] section
supplies the step count, batch shape (prompts per micro-batch), learning rate and warm-up; every
other [train] key applies as it is. Full fine-tuning or LoRA (`[lora] rank > 0`), resumable
exactly (`--resume`: the same prompts and the same completions).

The run folder holds what a DPO run folder holds (metrics.jsonl with the rollout figures per step
and val_* at validation, config.toml, step_NNNNNN/ checkpoints, contract and tokenizer files) plus
`rl_data.json` (the prompt counts per split as the start-up line says them: those used, after the
ones too long for a row are left out; `too_long`: those left out). Every other command takes its
checkpoints as it takes an SFT run's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from lmforge.config import Config, check_rl
from lmforge.data.conversations import cap_examples
from lmforge.data.prompts import Prompt, PromptStream, read_prompts, split_prompts, stdlib_prompts
from lmforge.errors import DataError
from lmforge.runtime import decode_runtime
from lmforge.sandbox import isolation_line
from lmforge.scorers.rewards import SANDBOXED, Rewards
from lmforge.scorers.static import static_verdict
from lmforge.stages.common import log, run_training, startup_report, training_session
from lmforge.stages.tuning import chat_template_line, lora_line, require_training, start_tuning
from lmforge.train.rl import RLObjective, token_reference

RL_DATA_FILE = "rl_data.json"
#: Held-out prompts per validation batch (greedy decoding, one batch at a time).
VAL_BATCH = 16


def load_prompts(cfg: Config) -> tuple[dict[str, list[Prompt]], dict]:
    """Prompts by split, and counts. "stdlib": the SFT task's functions whose reference passes
    the static check (the SFT split); a file: split by the prompt's hash with data.val_fraction.
    Training prompts capped at rl.max_examples, held-out ones at rl.val_examples.

    Raises:
        DataError: a bad file (file and line), or no training prompt.
    """
    d, p = cfg.data, cfg.rl
    info: dict = {"source": p.data}
    if p.data == "stdlib":
        prompts = stdlib_prompts(d.val_fraction, p.max_chars, d.include_tests,
                                 keep=lambda ex: static_verdict(ex.signature, ex.body, True, ex.module).ok)
    else:
        prompts = split_prompts(read_prompts(p.data), d.val_fraction)
    prompts["train"] = cap_examples(prompts["train"], p.max_examples, lambda x: x.key)
    prompts["val"] = cap_examples(prompts["val"], p.val_examples, lambda x: x.key)
    require_training(prompts, cfg, "rl", "prompt")
    info["prompts"] = {split: len(ps) for split, ps in prompts.items()}
    return prompts, info


def render_prompts(prompts: list[Prompt], tok, budget: int, from_file: bool) -> tuple[list[Prompt], list[list[int]], int]:
    """Each prompt's ids (the chat template with the generation prompt). One longer than `budget`
    tokens (data.seq_len - rl.max_new_tokens) is refused in a file (naming it), left out of the
    standard library's (counted)."""
    kept, ids, dropped = [], [], 0
    for p in prompts:
        x = tok.render_chat(p.messages, add_generation_prompt=True).ids
        if len(x) > budget:
            if from_file:
                raise DataError(f"{p.where}: the prompt is {len(x)} tokens; with rl.max_new_tokens it must fit "
                                f"data.seq_len: at most {budget} tokens. Shorten it, or raise data.seq_len (up to the "
                                f"model's max_seq_len) or lower rl.max_new_tokens.")
            dropped += 1
            continue
        kept.append(p)
        ids.append(x)
    return kept, ids, dropped


def rl_stage(cfg: Config, out: str | Path, resume: bool = False, dry_run: bool = False,
             progress: bool = True) -> dict:
    """Train the checkpoint `rl.init` with rewards on `rl.data`'s prompts; returns the last step's
    metrics (with the val_* figures of the held-out prompts).

    Raises:
        ConfigError: rl.init not set, lora.dropout > 0, rl.max_new_tokens leaving no room in
        data.seq_len (`config.check_rl`); a reward that cannot be imported; a config that does not
        fit the checkpoint.
        CheckpointError / ContractError: rl.init is not a checkpoint, or has another tokenizer.
        DataError: bad prompts (naming file and line), rl.data not a regular file, or nothing left to
        train on.
        RewardError: a reward function of yours raised, called sys.exit, changed the working folder,
        ran past rl.reward_timeout_s per completion or returned something else than rewards.
        Interrupted: SIGINT/SIGTERM before training (in it, the run stops after the step, with a
        checkpoint: a signal while a reward of yours runs included, lmforge.scorers.rewards).
    """
    check_rl(cfg)  # before --out or the checkpoint is touched
    start = start_tuning(cfg, out, resume, "rl")
    cfg, model, tok, init = start.cfg, start.model, start.tok, start.init
    rewards = Rewards(cfg.rl.rewards, cfg.rl.reward_timeout_s)  # a reward of yours is imported before any work
    with training_session(cfg, out, "rl", resume, dry_run) as session:
        info, rt, model = session.info, session.runtime, session.place(model)
        d, t, p = cfg.data, cfg.train, cfg.rl
        t0 = time.perf_counter()
        prompts, data_info = load_prompts(cfg)
        budget = d.seq_len - p.max_new_tokens  # a row holds the prompt and its longest completion
        rendered = {split: render_prompts(ps, tok, budget, p.data != "stdlib") for split, ps in prompts.items()}
        train, train_ids, dropped = rendered["train"]
        val, val_ids, val_dropped = rendered["val"]
        if not train:  # the standard library's prompts too long for a row were left out: all of them
            raise DataError(f"rl.data = {p.data!r}: no training prompt fits data.seq_len {d.seq_len} with "
                            f"rl.max_new_tokens {p.max_new_tokens} ({dropped} too long). Raise data.seq_len.")
        rewards.score(train[:1] * 2, ["", "    return 0"], [True, True])  # a reward that cannot score stops here
        stream = PromptStream(len(train), t.micro_batch_size, t.seed, rank=info.rank, world_size=info.world_size)
        reference = token_reference(model, rt, p.temperature) if p.beta > 0 else None  # no KL term: no copy
        objective = RLObjective(p, model, tok, train, train_ids, rewards, decode_runtime(rt.device), t.seed,
                                val, val_ids, reference, compile_decode=cfg.generate.compile)
        data_info.update(seconds=round(time.perf_counter() - t0, 2), prompts={"train": len(train), "val": len(val)},
                         too_long={"train": dropped, "val": val_dropped},  # left out: `prompts` counts what is used
                         seq_len=d.seq_len, init=str(init), rewards=p.rewards, group_size=p.group_size,
                         loss_type=p.loss_type, temperature=p.temperature, max_new_tokens=p.max_new_tokens)

        def val_batches():
            return [list(range(i, min(i + VAL_BATCH, len(val)))) for i in range(0, len(val), VAL_BATCH)]

        if info.is_main:
            _say_startup(cfg, model, tok, init, rt, objective, info.world_size, train_ids, val_ids,
                         dropped + val_dropped, budget)
        side = {RL_DATA_FILE: json.dumps(data_info, indent=2, default=str) + "\n"}  # what the run was fed
        try:
            return run_training(session, tok.folder, model, stream, val_batches if val else None,
                                resume=resume, dry_run=dry_run, progress=progress, side_files=side,
                                objective=objective, inputs={} if p.data == "stdlib" else {"rl.data": Path(p.data)})
        finally:
            rewards.close()  # the sandbox's waiting interpreters, whatever stopped the run


def _say_startup(cfg: Config, model, tok, init: Path, rt, objective, world_size: int, train_ids: list,
                 val_ids: list, dropped: int, budget: int) -> None:
    """The start-up lines of an RL run (the main process's): the run, `startup_report`, the
    template, LoRA, the prompts (`*_ids`: each prompt's rendered ids; `dropped`: left out as
    longer than `budget` tokens) and, where code runs, the sandbox's isolation."""
    p = cfg.rl
    report = {split: {"documents": len(ids), "tokens": sum(map(len, ids)),
                      "max_id": max((max(x) for x in ids), default=-1)}
              for split, ids in (("train", train_ids), ("val", val_ids))}
    log(f"rl: init {init}; prompts {p.data!r}; rewards {', '.join(p.rewards)}; {p.group_size} completions "
        f"per prompt at temperature {p.temperature:g}, at most {p.max_new_tokens} tokens; loss {p.loss_type}"
        + (f", KL to the init x {p.beta:g}" if p.beta > 0 else ", no KL term (no reference model)")
        + ("; rollouts packed in rows (each its own segment)" if p.packing else
           "; one rollout a right-padded row"))
    log(startup_report(model, tok, report, cfg, world_size, rt, objective))
    log(f"rl: {chat_template_line(tok)}")
    if cfg.lora.rank > 0:
        log(f"rl: {lora_line(cfg, model, init)}")
    log(f"rl data: {len(train_ids)} training prompts, {len(val_ids)} held out; {dropped} left out "
        f"(longer than {budget} tokens)")
    if SANDBOXED & set(p.rewards) or (p.data == "stdlib" and val_ids):  # a reward or val_behaviour runs code
        log(isolation_line())


__all__ = ["rl_stage", "load_prompts", "RL_DATA_FILE"]
