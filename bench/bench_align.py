"""Preference tuning and RL of a user's own model: `lmforge dpo` / `lmforge rl` against TRL's
`DPOTrainer` / `GRPOTrainer` with PEFT, side by side.

The model is bench_finetune.py's: a `transformers` folder as a user brings it, built here with random
weights (nothing is downloaded), of the SmolLM2-135M shape (`LlamaForCausalLM`, 576 x 30 layers, 9 / 3
heads, vocabulary 49,152, tied head) with a 49,152-token stdlib BPE and SmolLM2's chat template;
lmforge reads it with `lmforge import-hf`, TRL with `AutoModelForCausalLM.from_pretrained`. LoRA on
both sides: rank 16, alpha 16, no dropout, every linear layer of the blocks (lmforge's `--set
lora.rank=16` as typed; PEFT's `LoraConfig` with q, k, v, o, gate, up, down).

DPO (arms `lmforge-dpo`, `trl-dpo`), the same work on both sides:
- the pairs: lmforge's embedded `stdlib_preference_pairs` (a function's real body against a mutated
  copy), written once as TRL's explicit conversational records ({prompt: [user], chosen:
  [assistant], rejected: [assistant]}), lmforge's `dpo.data`; lmforge splits that file by the
  prompt's hash and deals the training pairs with its seeded `PairStream`: TRL gets those pairs in
  that order (a sequential sampler), `--pairs` a step (dpo.micro_batch_size), so every step of
  both sides sees the same pairs;
- lmforge's dpo defaults: beta 0.1, the sigmoid loss, lr 1e-4, 10 warm-up steps, cosine to
  lr x train.min_lr_ratio (TRL's `cosine`), AdamW betas 0.9 / 0.95, weight decay 0.1, clip 1.0;
  rows of `--seq-len` tokens a side (TRL's `max_length`, the tail cut: `keep_start`); the same
  precision (`precision = "auto"`: bf16 autocast where the CPU has bf16 units, else float32; TRL's `bf16`);
- the reference: the model with its adapters disabled, computed every step, on both sides
  (lmforge's `dpo.reference = "live"`; TRL with a PEFT model and `precompute_ref_log_probs=False`).
Figures: seconds per optimizer step after `--warmup`, tokens/s (both sides of the step's pairs, real
tokens, the same count for both), peak RSS, and the first and last step's loss (the first is ln 2 =
0.6931 on both sides: policy = reference before the first update).

RL (arms `lmforge-rl`, `trl-grpo`): `lmforge rl` on its default prompts (standard-library functions
to write) and reward ("static": parses under its signature, ends its turn, is not trivial, every
name resolves); TRL gets the same prompts in the order lmforge deals them (no shuffle) as a
conversational prompt dataset with the prompts' fields, and lmforge's own `static` reward
(`lmforge.scorers.rewards.REWARDS`) as a TRL reward function. The same group size (rl.group_size 8:
`num_generations`), prompts a step (rl.micro_batch_size 4: 32 completions, one generation batch = one
optimizer step, `num_iterations=1`: on policy), budget (rl.max_new_tokens 96:
`max_completion_length`), temperature 1.0 with no top-k / top-p, stop ids (<|im_end|> and
<|endoftext|>), lr 3e-5 at a constant rate, AdamW settings, precision; Dr. GRPO on both sides
(advantage = reward - group mean, TRL's `scale_rewards="none"`; the loss over rows x budget, TRL's
`loss_type="dr_grpo"`), no KL term (beta 0: no reference model), no vLLM. A step's time is its
rollouts, their scoring and the update. Random weights sample to the token budget on both sides
(the same work); the reward is then 0 everywhere, so the figure column (mean reward, mean completion
length) only shows that both sides did the same work.

Where the two sides still differ (unavoidable or TRL as it comes):
- TRL turns activation checkpointing on by default (`gradient_checkpointing=True`, also in
  DPOConfig and GRPOConfig): each decoder layer recomputed in backward; lmforge's is off by default,
  and on in the `-ac` arms (`--set train.activation_checkpointing=true`: the same gradients bit for bit);
- lmforge packs a DPO step's sides into rows with per-segment attention (`dpo.packing`), and a RL
  step's rollouts likewise (`rl.packing`); TRL pads (its DPO `padding_free` is disabled in this
  version), so it computes on padding the step does not count;
- transformers' linear warm-up trains its first step at lr 0 (lmforge's at lr / warmup_steps);
- lmforge decodes rollouts with the LoRA adapters merged into the weights (`train.rl.decoding`),
  TRL through PEFT's unmerged adapters; lmforge's rollouts run in lmforge's decode precision, TRL's
  under its autocast;
- TRL's DPO completion is everything after the rendered prompt, so it also scores the chat template's
  newline after <|im_end|> (one more target token a side); lmforge learns the reply and its
  <|im_end|> only. At the real shape TRL's step-1 log p(chosen) is therefore about one token's
  ln 49,152 lower (2026-11-29: -751.60 against -740.72; transformers in fp32 gives -751.597 with the
  newline, -740.716 without); a side longer than a row is cut to `--seq-len` + 1 tokens by lmforge
  and `--seq-len` by TRL;
- TRL's DPO and GRPO materialise the (rows, length, 49,152) logits; lmforge's losses run through its
  fused head (the logits never materialised);
- both sides' "completions/mean_length" count the stop token (TRL's completion mask includes the
  first EOS); the samples themselves differ (each side's own random generator).

Each arm is its own process (`--arm`), so its peak resident memory is its own, and the arms
alternate round by round (`--repeat`).

    python bench/bench_align.py [--steps 3] [--warmup 1] [--repeat 1] [--arms lmforge-dpo,trl-dpo,...]
    python bench/bench_align.py --smoke     # a tiny Llama, about a minute: proves the benchmark runs

Needs `trl` and `peft` (`pip install -e ".[bench]"`); without TRL the TRL arms are rows saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from align_dpo import prepare_dpo, run_lmforge_dpo, run_trl_dpo  # noqa: E402
from align_rl import prepare_rl, run_lmforge_rl, run_trl_grpo  # noqa: E402
from bench_finetune import import_user_folder, run_rounds  # noqa: E402

ARMS = ("lmforge-dpo", "lmforge-dpo-ac", "trl-dpo", "lmforge-rl", "lmforge-rl-ac", "trl-grpo")
#: the `-ac` arms: lmforge with `--set train.activation_checkpointing=true` (TRL's configs have it on)
RUNNERS = {"lmforge-dpo": run_lmforge_dpo, "lmforge-dpo-ac": run_lmforge_dpo, "trl-dpo": run_trl_dpo,
           "lmforge-rl": run_lmforge_rl, "lmforge-rl-ac": run_lmforge_rl, "trl-grpo": run_trl_grpo}
#: each lmforge arm's TRL counterpart (the ratio column)
TWIN = {"lmforge-dpo": "trl-dpo", "lmforge-dpo-ac": "trl-dpo", "lmforge-rl": "trl-grpo", "lmforge-rl-ac": "trl-grpo"}
#: --smoke: a tiny Llama, 3 steps, small steps (figures mean nothing)
SMOKE_SIZES = dict(steps=3, warmup=1, seq_len=384, pairs=2, prompts=2, group=2, new_tokens=12, val=2,
                   arms="lmforge-dpo,lmforge-dpo-ac,trl-dpo,lmforge-rl,trl-grpo")


def defaults() -> dict:
    """The run's shape from lmforge's own defaults: pairs a DPO step (dpo.micro_batch_size), prompts a
    RL step (rl.micro_batch_size), group size, completion budget."""
    from lmforge.config import Config

    cfg = Config()
    return {"pairs": cfg.dpo.micro_batch_size, "prompts": cfg.rl.micro_batch_size, "group": cfg.rl.group_size,
            "new_tokens": cfg.rl.max_new_tokens}


def prepare(work: Path, a, arms: list[str]) -> None:
    """The user's folder, its import, and the data of the arms asked for (an `-ac` arm's included)."""
    import_user_folder(work, a.smoke)
    if any("-dpo" in x for x in arms):
        prepare_dpo(work, a)
    if any("-rl" in x or "-grpo" in x for x in arms):
        prepare_rl(work, a)


def child(a) -> None:
    """One arm in this process; its result as the last line of stdout (JSON)."""
    res = RUNNERS[a.arm](a.work, a)
    res["peak_rss_mb"] = common.peak_rss_mb()
    print(json.dumps(res))


SHAPE_FLAGS = ("steps", "warmup", "seq_len", "pairs", "prompts", "group", "new_tokens", "val", "seed")


def arm_process(work: Path, arm: str, a) -> dict:
    """`arm` in a child process of its own (its peak RSS its own): its result, or {"failed": why}."""
    argv = [sys.executable, __file__, "--arm", arm, "--work", str(work)]
    for name in SHAPE_FLAGS:
        argv += [f"--{name.replace('_', '-')}", str(getattr(a, name))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(common.ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(argv + (["--smoke"] if a.smoke else []), capture_output=True, text=True, env=env)
    if res.returncode:
        lines = [x for x in res.stderr.strip().splitlines() if x.strip() and not x.startswith(" ")]
        last = f": {lines[-1]}" if lines and res.returncode > 0 else ""  # a signal's status says it all
        return {"failed": f"{common.exit_status(res.returncode)}{last}", "stderr": res.stderr[-3000:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def figure(res: dict) -> str:
    """The arm's quality figure: DPO's first and last step loss and the first step's mean log p of the
    chosen replies (nats summed over a reply: the same pairs and weights give the same number on both
    sides), RL's mean reward and completion length (tokens)."""
    if "first_loss" in res:
        return (f"loss {res['first_loss']:.4f} -> {res['last_loss']:.4f}, step 1 log p(chosen) "
                f"{res['first_logp_chosen']:.2f}")
    return f"reward {res['reward']:.3f}, {res['mean_length']:.1f} tokens a completion"


def table_rows(results: dict[str, list[dict]]) -> list[list]:
    """One row an arm: medians over its rounds; an lmforge arm's ratio to its TRL twin (TRL's
    s/step over lmforge's: the speed-up; lmforge's peak RSS over TRL's)."""
    rows = []
    med = {}
    for arm, runs in results.items():
        ok = [x for x in runs if "failed" not in x]
        if ok:
            med[arm] = {k: statistics.median(x[k] for x in ok) for k in ("s_per_step", "tokens_per_s", "peak_rss_mb")}
    for arm, runs in results.items():
        if arm not in med:
            rows.append([arm, runs[0]["failed"], "", "", "", ""])
            continue
        m, twin = med[arm], med.get(TWIN.get(arm, ""))
        ratio = (f"{twin['s_per_step'] / m['s_per_step']:.2f}x faster / "
                 f"{m['peak_rss_mb'] / twin['peak_rss_mb']:.2f}x memory") if twin else ""
        ok = [x for x in runs if "failed" not in x]
        rows.append([arm, f"{m['s_per_step']:.3f}", f"{m['tokens_per_s']:,.0f}", f"{m['peak_rss_mb']:,.0f}",
                     figure(ok[0]), ratio])
    return rows


def parse(argv) -> argparse.Namespace:
    d = defaults()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps a run (3 x 6 arms: ~35 min on 2 cores)")
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of s/step and tokens/s")
    ap.add_argument("--seq-len", type=int, default=512, help="data.seq_len: a DPO side's or a rollout's row, tokens")
    ap.add_argument("--pairs", type=int, default=d["pairs"], help="preference pairs a DPO step (dpo.micro_batch_size)")
    ap.add_argument("--prompts", type=int, default=d["prompts"], help="prompts a RL step (rl.micro_batch_size)")
    ap.add_argument("--group", type=int, default=d["group"], help="completions a prompt (rl.group_size)")
    ap.add_argument("--new-tokens", type=int, default=d["new_tokens"], help="a completion's budget, tokens")
    ap.add_argument("--val", type=int, default=8, help="held-out items lmforge validates on at the end (untimed)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every arm, alternating")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    common.smoke_flag(ap)
    a = ap.parse_args(argv)
    if a.smoke and not a.arm:
        for k, v in SMOKE_SIZES.items():
            setattr(a, k, v)
    if a.warmup >= a.steps:
        ap.error(f"--warmup {a.warmup} leaves no timed step of --steps {a.steps}")
    unknown = [x for x in a.arms.split(",") if x and x not in ARMS]
    if unknown:
        ap.error(f"unknown arms {unknown}: expected some of {', '.join(ARMS)}")
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    if a.arm:
        child(a)
        return {}
    arms = [x for x in a.arms.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-align-") as tmp:
        work = Path(tmp)
        prepare(work, a, arms)
        results = run_rounds(arms, a.repeat, lambda arm: arm_process(work, arm, a))
    for arm, runs in results.items():
        for x in runs:
            if "stderr" in x:
                print(f"{arm} failed:\n{x['stderr']}", file=sys.stderr)
    shape = "tiny Llama (SMOKE)" if a.smoke else "SmolLM2-135M shape"
    print(common.table(["arm", "s/step", "tokens/s", "peak RSS MB", "figure", "lmforge / TRL: speed, memory"],
                       table_rows(results),
                       title=f"DPO and RL of a user's {shape} with LoRA rank 16, {a.steps} steps (timed after "
                             f"{a.warmup}); DPO {a.pairs} pairs a step, rows of {a.seq_len}; RL {a.prompts} prompts "
                             f"x {a.group} completions of <= {a.new_tokens} tokens; {common.machine_line()}"
                             + (" (SMOKE RUN: figures mean nothing)" if a.smoke else "")))
    return {"results": results, "steps": a.steps, "warmup": a.warmup, "seq_len": a.seq_len}


if __name__ == "__main__":
    main()
