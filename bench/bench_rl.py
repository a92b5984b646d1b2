"""RL with verifiable rewards on the speedrun's SFT model: does it lift what the speedrun measures?

From an SFT checkpoint (default: the speedrun's, runs/speedrun/sft), `lmforge rl --set rl.init=CKPT`
exactly as docs/rl.md types it (its own defaults: the standard-library prompts, the static reward —
parses under its signature, ends its turn, not a stub, every name resolves —, `rl.steps`, AdamW at a
constant rate); a benchmark changes only `train.seed` and, with `--minutes`, `train.time_limit_s`
(`arm_config`). Then the speedrun's own held-out figure:

- baseline: the SFT model's held-out **plain greedy** "parses and ends its turn with <|im_end|>"
  (`scorers.body_parse_rate` on the speedrun's held-out prompts, `held_out_prompts(sft_val.jsonl,
  64)`, 160 new tokens, no repetition penalty), the static pass rate of those bodies, the share of
  trivial ones, and the held-out SFT loss (nats per supervised token on sft_val.jsonl);
- arms, each `lmforge rl` as docs/rl.md types it: full fine-tuning, LoRA (`--set lora.rank=16`), and a control
  whose rewards are permuted within each micro-batch (it must stay near the baseline, or the
  figure moves for another reason than the reward);
- each with its rates' 95% Wilson intervals (63 prompts), the RL steps taken and seconds.
  `--seeds N` repeats every arm with N training seeds (mean, min-max);
- behaviour (`scorers.behaviour`: the body returns what the real function returns on generated
  inputs, in the sandbox), plain greedy, on every held-out function it covers (the SFT split's)
  and on 64 training functions it covers, with 95% Wilson intervals.

An arm is `NAME[:REWARDS]`: `full`, `lora` or `shuffled`, trained on `rl.rewards` REWARDS joined
by "+" (default `--rewards`), e.g. `--arms full:static,full:static+behaviour,lora:static+behaviour`.

Run: `python bench/bench_rl.py [--checkpoint DIR] [--seeds 3] [--arms full,shuffled,lora] [--minutes M]`.
Skipped (a note, exit 0) when the checkpoint is absent: `make speedrun` writes it.
`--smoke`: a tiny model trained in seconds (figures mean nothing; proves the benchmark runs).
`--speed`: instead, the rollout's tokens per second (sampling with the sampler's log-probabilities, the
static reward, the batch built: `RLObjective.next_batch`) beside plain `generate` at the same batch (4
prompts x 8 completions, 96 new tokens, temperature 1) as shipped, without dropping stopped rows
(`generate.COMPACT_STOPPED`) and as before issue 48 (neither that nor a group's prompt prefilled once,
`generate.SHARE_PREFILL`), interleaved round by round in one process, with whether the ids were equal;
and the loss's forward + backward on each round's rollouts, one rollout a right-padded row against
packed rows (`rl.packing`), interleaved, with each layout's padding share.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import common  # noqa: F401  (puts src/ on the path)

from lmforge.data.conversations import Conversation, render_samples, sft_batches
from lmforge.evaluate import evaluate_batches
from lmforge.generate import COMPACT_STOPPED
from lmforge.loading import load_checkpoint
from lmforge.model.io import read_checkpoint_meta, resolve_checkpoint
from lmforge.runtime import decode_runtime, training_runtime
from lmforge.scorers import body_parse_rate, held_out_prompts
from lmforge.scorers.intervals import wilson_interval
from lmforge.scorers.static import static_verdict
from lmforge.stages import rl as rl_module
from lmforge.stages.rl import rl_stage
from lmforge.stages.sft import SFT_VAL_FILE

DEFAULT_CHECKPOINT = common.ROOT / "runs" / "speedrun" / "sft"
EVAL_PROMPTS, EVAL_NEW_TOKENS = 64, 160
#: arm -> (the --set overrides of the README's command for it, rewards shuffled): every arm is
#: `lmforge rl --set rl.init=CKPT` as docs/rl.md types it, plus only these, the seed and the time.
ARMS = {"full": ([], False), "lora": (["lora.rank=16", "rl.lr=2e-4"], False), "shuffled": ([], True)}
#: --smoke: the tiny checkpoint's short rows, tiny rollouts (figures mean nothing).
SMOKE_SETS = ["data.seq_len=512", "rl.max_new_tokens=8", "rl.group_size=2", "rl.micro_batch_size=2",
              "rl.max_examples=8", "rl.steps=2"]


def arm_config(ckpt: Path, kind: str, rewards: list[str], seed: int, minutes: float = 0.0, smoke: bool = False):
    """The config `lmforge rl --set rl.init=CKPT [the arm's --set] --set train.seed=SEED` trains with
    (no --config: the command's own defaults, loaded as the CLI loads them), with
    `train.time_limit_s` = `minutes` x 60 when given; `rewards` other than the default are the
    arm's `rl.rewards`. tests/test_bench_smoke.py holds it equal to the command's."""
    from lmforge.config import load_config

    sets = [f"rl.init={ckpt}", *ARMS[kind][0], f"train.seed={seed}"]
    if rewards != load_config(None, []).rl.rewards:
        sets.append("rl.rewards=" + json.dumps(rewards))
    if minutes:
        sets.append(f"train.time_limit_s={minutes * 60:g}")
    return load_config(None, sets + (SMOKE_SETS if smoke else []))


def held_out(model, tok, items, seq_len: int) -> dict:
    """The speedrun's plain greedy figure, the static pass rate and trivial share of those bodies,
    and the held-out SFT loss."""
    r = body_parse_rate(model, tok, items, EVAL_NEW_TOKENS, runtime=decode_runtime())
    static = trivial = no_param = 0
    for item, ex in zip(items, r["examples"]):
        v = static_verdict(item["signature"], ex["body"], ex["stopped"], item["name"].partition(":")[0])
        static += v.ok
        trivial += v.trivial
        no_param += v.reason == "reads no parameter"
    n = r["n"]
    convs = [Conversation(tuple(x["messages"]), x["name"], x["name"]) for x in items]
    samples = render_samples(convs, tok, seq_len)
    nats, count = evaluate_batches(model, sft_batches(samples, seq_len, 8, tok.pad_id), training_runtime("fp32"))
    return {"n": n, "parse_end": r["parsed_and_im_end"] / n, "parse_end_ci": wilson_interval(r["parsed_and_im_end"], n),
            "static": static / n, "static_ci": wilson_interval(static, n), "trivial": trivial / n,
            "reads_no_parameter": no_param / n,
            "sft_loss": nats / max(count, 1)}


def behaviour_sets(cfg, tok, rewards) -> dict[str, list]:
    """The prompts the behaviour reward covers: every held-out one, and 64 training ones (cap_examples)."""
    from lmforge.data.conversations import cap_examples
    from lmforge.data.prompts import stdlib_prompts

    budget = EVAL_NEW_TOKENS
    ps = stdlib_prompts(cfg.data.val_fraction, cfg.rl.max_chars, False,
                        keep=lambda ex: static_verdict(ex.signature, ex.body, True, ex.module).ok
                        and len(tok.encode(ex.body)) < budget)
    out = {}
    for split, n in (("val", 0), ("train", 64)):
        xs = [p for p in ps[split] if "." not in p.fields["qualname"]]
        xs = cap_examples(xs, 10 * n, lambda p: p.key) if n else xs
        rewards.behaviour(xs, [""] * len(xs), ["not run"] * len(xs))  # finds their cases
        covered = [p for p in xs if rewards._behaviour.cases.get(p.where)]
        out[split] = covered[:n] if n else covered
    return out


def behaviour_rate(model, tok, prompts, rewards) -> dict:
    """Plain greedy bodies for `prompts`; the share the behaviour reward passes, with its interval."""
    items = [{"messages": p.messages, "signature": p.fields["signature"], "name": p.where} for p in prompts]
    r = body_parse_rate(model, tok, items, EVAL_NEW_TOKENS, runtime=decode_runtime())
    bodies, stopped = [x["body"] for x in r["examples"]], [x["stopped"] for x in r["examples"]]
    scores, _ = rewards.behaviour(prompts, bodies, rewards.static_reasons(prompts, bodies, stopped))
    passed = sum(v or 0.0 for v in scores)
    n = len(prompts)
    return {"rate": passed / max(n, 1), "ci": wilson_interval(int(passed), n), "n": n}


class ShuffledRewards(rl_module.Rewards):
    """The control: each micro-batch's rewards permuted (seeded), so they no longer say which
    completion was good."""

    seed = 0

    def score(self, prompts, completions, stopped):
        s = super().score(prompts, completions, stopped)
        rng = random.Random(f"{self.seed}:{len(completions)}:{sum(s.total)}:{completions[0][:20]}")
        rng.shuffle(s.total)
        return s


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=None, help=f"SFT checkpoint (default {DEFAULT_CHECKPOINT})")
    ap.add_argument("--minutes", type=float, default=0.0,
                    help="train.time_limit_s of each RL run in minutes (0: none, the command's own rl.steps)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--arms", default="full,shuffled", help="NAME[:REWARDS], comma-separated (module docstring)")
    ap.add_argument("--rewards", default="static", help="rl.rewards of an arm that names none, joined by '+'")
    ap.add_argument("--speed", action="store_true", help="measure the rollout's tokens/s against generate instead")
    ap.add_argument("--rounds", type=int, default=4)
    common.smoke_flag(ap)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-rl-") as tmp:
        tmp = Path(tmp)
        if args.smoke:
            from bench_dpo import smoke_checkpoint

            ckpt, args.minutes, args.seeds = smoke_checkpoint(tmp), 0.05, 1
        else:
            ckpt = args.checkpoint or DEFAULT_CHECKPOINT
            if not ckpt.exists():
                print(f"bench_rl: skipped: no SFT checkpoint at {ckpt} (`make speedrun` writes one, or pass --checkpoint)")
                return {"skipped": f"no checkpoint at {ckpt}"}
        return rollout_speed(ckpt, args) if args.speed else run(ckpt, args, tmp)


#: --speed's generate arms: (generate.SHARE_PREFILL, generate.COMPACT_STOPPED, torch.multinomial as the
#: sampler instead of `generate.draw`); "generate" is as shipped. The first three draw the same ids.
GENERATE_ARMS = {"generate": (True, COMPACT_STOPPED, False), "stopped rows decoded": (True, 0, False),
                 "every row prefilled, stopped rows decoded": (False, 0, False),
                 "before issue 48": (False, 0, True)}
GENERATE_ARM_SETTINGS = {"stopped rows decoded": "COMPACT_STOPPED = 0",
                         "every row prefilled, stopped rows decoded": "SHARE_PREFILL off, COMPACT_STOPPED = 0",
                         "before issue 48": "and torch.multinomial's sampler (V exponentials a row): other ids"}


def _multinomial(probs, generator=None):
    """The sampler before issue 48 (`torch.multinomial`), for the "before issue 48" arm."""
    import torch

    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def rollout_speed(ckpt: Path, args) -> dict:
    """Tokens per second of a rollout and of plain sampling at the same batch (module docstring)."""
    import torch

    from lmforge.config import SamplingConfig
    from lmforge.data.prompts import PromptStream, stdlib_prompts
    from lmforge.generate import generate
    from lmforge.train.rl import RLObjective

    ckpt = resolve_checkpoint(ckpt)
    cfg, _ = read_checkpoint_meta(ckpt)
    model, tok, _, _ = load_checkpoint(ckpt)
    rt = decode_runtime()
    prompts = stdlib_prompts(cfg.data.val_fraction, cfg.rl.max_chars, False,
                             keep=lambda ex: static_verdict(ex.signature, ex.body, True, ex.module).ok)["train"][:200]
    ids = [tok.render_chat(p.messages, add_generation_prompt=True).ids for p in prompts]
    kept = [(p, x) for p, x in zip(prompts, ids) if len(x) <= cfg.data.seq_len - 96]
    prompts, ids = [p for p, _ in kept], [x for _, x in kept]
    rl_cfg = replace(cfg.rl, max_new_tokens=96, group_size=8, temperature=1.0)
    objective = RLObjective(rl_cfg, model, tok, prompts, ids, rl_module.Rewards(["static"]), rt, seed=0)
    stream = PromptStream(len(prompts), 4, seed=0)
    sampling = SamplingConfig(max_new_tokens=96, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
    import lmforge.generate as gen_module

    shipped_draw = gen_module.draw

    rollout, speeds, same, step = [], {arm: [] for arm in GENERATE_ARMS}, 0, {"padded": [], "packed": []}
    padding = {"padded": [], "packed": []}
    for r in range(args.rounds):
        t0 = time.perf_counter()
        batch = objective.next_batch(stream, model)
        rollout.append(int(batch.loss_mask.sum()) / (time.perf_counter() - t0))
        # the training forward + backward on these rollouts, one rollout a row against packed (rl.packing)
        layouts = {"padded": replace(batch, rows=None, unpack=None), "packed": batch}
        for name in (("padded", "packed") if r % 2 == 0 else ("packed", "padded")):
            b = layouts[name]
            if name == "padded":
                R, T = b.tokens.shape
                b.slots = (R * T - (b.slots[1] - b.slots[0]), R * T)
            model.train()
            t0 = time.perf_counter()
            num, _ = objective.loss(model, b)
            (num / objective.count(b)).backward()
            step[name].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
            padding[name].append(b.slots[0] / b.slots[1])
        rows = [ids[i % len(ids)] for i in range(4 * r, 4 * r + 4) for _ in range(8)]
        outs = {}
        arms = list(GENERATE_ARMS) if r % 2 == 0 else list(reversed(GENERATE_ARMS))
        for arm in arms:  # interleaved, the order flipped every round
            gen_module.SHARE_PREFILL, gen_module.COMPACT_STOPPED, old_sampler = GENERATE_ARMS[arm]
            gen_module.draw = _multinomial if old_sampler else shipped_draw
            t0 = time.perf_counter()
            outs[arm] = generate(model, rows, [tok.im_end_id, tok.eos_id], sampling, tok.pad_id,
                                 generator=torch.Generator().manual_seed(r), runtime=rt)
            speeds[arm].append(sum(map(len, outs[arm])) / (time.perf_counter() - t0))
        gen_module.SHARE_PREFILL, gen_module.COMPACT_STOPPED, _ = GENERATE_ARMS["generate"]
        gen_module.draw = shipped_draw
        same += all(o == outs["generate"] for arm, o in outs.items() if not GENERATE_ARMS[arm][2])
    a = common.Stats(rollout)
    s = {arm: common.Stats(v) for arm, v in speeds.items()}
    b, before = s["generate"], s["before issue 48"]
    print(common.table(["", "tokens/s (median)", "min-max"],
                       [["rollout (RLObjective.next_batch)", f"{a.median:,.0f}", a.spread()],
                        ["generate, same batch", f"{b.median:,.0f}", b.spread()],
                        ["ratio generate / rollout", f"{b.median / a.median:.2f}x", ""],
                        *[[f"generate, {arm} ({GENERATE_ARM_SETTINGS[arm]})", f"{x.median:,.0f}", x.spread()]
                          for arm, x in s.items() if arm != "generate"],
                        [f"ratio generate / before issue 48 (the first three arms' ids equal: {same} of "
                         f"{args.rounds} rounds)", f"{b.median / before.median:.2f}x", ""]],
                       title=f"rollout speed, 4 prompts x 8 completions, 96 new tokens, {args.rounds} rounds; "
                             f"{common.machine_line()}"))
    p, q = common.Stats(step["padded"]), common.Stats(step["packed"])
    print(common.table(["rows", "padding (mean)", "forward + backward s (median)", "min-max"],
                       [["one rollout a row (rl.packing = false)", f"{statistics.mean(padding['padded']):.1%}",
                         f"{p.median:.3f}", p.spread("{:.3f}")],
                        ["packed (rl.packing = true)", f"{statistics.mean(padding['packed']):.1%}", f"{q.median:.3f}",
                         q.spread("{:.3f}")],
                        ["ratio padded / packed", "", f"{p.median / q.median:.2f}x", ""]],
                       title="the loss's forward + backward on the same rollouts (32 a micro-batch), interleaved"))
    return {"rollout_tokens_per_s": a.median, "generate_tokens_per_s": b.median, "loss_s_padded": p.median,
            "loss_s_packed": q.median, "padding_padded": statistics.mean(padding["padded"]),
            "padding_packed": statistics.mean(padding["packed"])}


def run(ckpt: Path, args, tmp: Path) -> dict:
    ckpt = resolve_checkpoint(ckpt)
    run_dir = ckpt.parent if ckpt.name.startswith("step_") else ckpt
    base_cfg, _ = read_checkpoint_meta(ckpt)
    sft, tok, _, _ = load_checkpoint(ckpt)
    items = held_out_prompts(run_dir / SFT_VAL_FILE, tok, EVAL_PROMPTS, EVAL_NEW_TOKENS - 1)
    seq_len = base_cfg.data.seq_len
    scorer = rl_module.Rewards(["static"])
    sets = behaviour_sets(base_cfg, tok, scorer)

    def measure(model) -> dict:
        r = held_out(model, tok, items, seq_len)
        for split, ps in sets.items():
            r[f"behaviour_{split}"] = behaviour_rate(model, tok, ps, scorer)
        return r

    base = measure(sft)
    print(f"baseline: plain greedy parse + <|im_end|> {base['parse_end']:.1%} of {base['n']}, static "
          f"{base['static']:.1%}, stubs {base['trivial']:.1%}, reads no parameter {base['reads_no_parameter']:.1%}, "
          f"SFT loss {base['sft_loss']:.4f}, behaviour held-out {_rate(base, 'val')}, training {_rate(base, 'train')}",
          flush=True)
    results: dict[str, list[dict]] = {}
    original = rl_module.Rewards
    for spec in [a for a in args.arms.split(",") if a]:
        kind, _, reward_spec = spec.partition(":")
        reward_names = (reward_spec or args.rewards).split("+")
        name = f"{kind} ({'+'.join(reward_names)})"
        for seed in range(args.seeds):
            cfg = arm_config(ckpt, kind, reward_names, base_cfg.train.seed + seed, args.minutes, args.smoke)
            ShuffledRewards.seed = seed
            rl_module.Rewards = ShuffledRewards if ARMS[kind][1] else original
            t0 = time.perf_counter()
            try:
                last = rl_stage(cfg, tmp / f"run-{kind}-{seed}", progress=False)
            finally:
                rl_module.Rewards = original
            seconds = time.perf_counter() - t0
            tuned = load_checkpoint(tmp / f"run-{kind}-{seed}", tok.folder)[0]
            r = measure(tuned)
            r.update(seconds=seconds, steps=last["step"], train_reward=last.get("reward"))
            print(f"{name} seed {seed}: parse + <|im_end|> {r['parse_end']:.1%}, static {r['static']:.1%}, stubs "
                  f"{r['trivial']:.1%}, reads no parameter {r['reads_no_parameter']:.1%}, SFT loss {r['sft_loss']:.4f} ({r['sft_loss'] / base['sft_loss'] - 1:+.1%}); "
                  f"behaviour held-out {_rate(r, 'val')}, training {_rate(r, 'train')}; "
                  f"{r['steps']} steps in {seconds:.0f} s", flush=True)
            import shutil
            shutil.rmtree(tmp / f"run-{kind}-{seed}", ignore_errors=True)
            results.setdefault(name, []).append(r)
    scorer.close()
    print_table(base, results, args)
    return {"checkpoint": str(ckpt), "minutes": args.minutes, "baseline": base, "arms": results,
            "machine": common.machine_line()}


def _rate(r: dict, split: str) -> str:
    b = r[f"behaviour_{split}"]
    return f"{b['rate']:.1%} of {b['n']} [{b['ci'][0]:.0%}, {b['ci'][1]:.0%}]"


def _behaviour(rows: list[dict], split: str) -> str:
    if len(rows) == 1:
        return _rate(rows[0], split)
    vals = [r[f"behaviour_{split}"]["rate"] for r in rows]
    return f"{statistics.mean(vals):.1%} ({min(vals):.1%}-{max(vals):.1%})"


def _mean(rows: list[dict], key: str) -> str:
    vals = [r[key] for r in rows]
    spread = f" ({min(vals):.1%}-{max(vals):.1%})" if len(vals) > 1 else \
        f" [{rows[0][key + '_ci'][0]:.0%}, {rows[0][key + '_ci'][1]:.0%}]" if key + "_ci" in rows[0] else ""
    return f"{statistics.mean(vals):.1%}{spread}"


def print_table(base: dict, results: dict, args) -> None:
    headers = ["model", "plain greedy: parse + <|im_end|>", "static reward", "stubs", "reads no parameter",
               "SFT loss (change)", "behaviour, held-out", "behaviour, training", "RL steps", "RL s"]
    ci = base["parse_end_ci"]
    rows = [["SFT (baseline)", f"{base['parse_end']:.1%} [{ci[0]:.0%}, {ci[1]:.0%}]", _mean([base], "static"),
             f"{base['trivial']:.1%}", f"{base['reads_no_parameter']:.1%}", f"{base['sft_loss']:.4f}",
             _rate(base, "val"), _rate(base, "train"), "-", "-"]]
    for name, rs in results.items():
        loss = statistics.mean(r["sft_loss"] for r in rs)
        rows.append([f"RL {name}", _mean(rs, "parse_end"), _mean(rs, "static"), _mean(rs, "trivial"),
                     _mean(rs, "reads_no_parameter"),
                     f"{loss:.4f} ({loss / base['sft_loss'] - 1:+.1%})", _behaviour(rs, "val"), _behaviour(rs, "train"),
                     f"{statistics.mean(r['steps'] for r in rs):.0f}", f"{statistics.mean(r['seconds'] for r in rs):.0f}"])
    limit = f"{args.minutes:g} min a run" if args.minutes else "the command's own steps"
    print(common.table(headers, rows, title=f"lmforge rl --set rl.init=CKPT as docs/rl.md types it, {limit}, "
                                            f"{args.seeds} seed(s); held-out prompts {base['n']}; {common.machine_line()}"
                                            + (" (SMOKE RUN: figures mean nothing)" if args.smoke else "")))


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), default=str)[:2000])
