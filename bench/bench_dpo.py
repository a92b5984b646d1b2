"""DPO on the embedded preference pairs: does it teach the model to prefer the real body?

From an SFT checkpoint (default: the speedrun's, runs/speedrun/sft), on the default pairs
(lmforge.data.stdlib_pairs: a standard-library function's real body against a copy with one
symmetric, parseable mutation; held-out pairs from the held-out modules only):

- baseline: the SFT model's held-out pairwise accuracy (log p(chosen) > log p(rejected) of the
  whole reply, the policy alone), per mutation kind, and its held-out loss on the chosen
  bodies (nats per completion token);
- arms, each `lmforge dpo` on the training pairs for the same steps: full fine-tuning, LoRA
  (rank 16, all linear layers of the blocks), and a control whose training labels are
  shuffled (chosen and rejected swapped at random in half the pairs: it must stay near the
  baseline, and its reward accuracy near chance, or the data leaks);
- for each: held-out pairwise accuracy (overall and per kind), held-out reward accuracy
  (policy vs reference margin > 0; chance is 50%), the chosen-body loss and its change
  against the SFT model, and the DPO training seconds. `--seeds N` repeats every arm with N
  training seeds (mean and min-max).

Every arm is `lmforge dpo --set dpo.init=CKPT` as docs/preference-tuning.md types it (its defaults: AdamW, cosine,
`dpo.steps`, `dpo.lr`); a benchmark changes only `train.seed` (`arm_config`).

Run: `python bench/bench_dpo.py [--checkpoint DIR] [--seeds 3] [--arms full,lora,shuffled]`. Skipped (a
note, exit 0) when the checkpoint is absent: `make speedrun` writes it.
`--smoke`: a tiny model trained in seconds (figures mean nothing; proves the benchmark runs).
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
import torch

from lmforge.data.preferences import pair_batches, pair_from_record, render_pairs
from lmforge.data.stdlib_pairs import PairStats, stdlib_preference_pairs
from lmforge.loading import load_checkpoint
from lmforge.model.io import read_checkpoint_meta, resolve_checkpoint
from lmforge.runtime import training_runtime
from lmforge.stages.dpo import dpo_stage
from lmforge.train.dpo import sequence_logps

DEFAULT_CHECKPOINT = common.ROOT / "runs" / "speedrun" / "sft"
#: arm -> (the --set overrides of the README's command for it, labels shuffled): every arm is
#: `lmforge dpo --set dpo.init=CKPT` as docs/preference-tuning.md types it, plus only these and the seed.
ARMS = {"full": ([], False), "lora": (["lora.rank=16"], False), "shuffled": ([], True)}
#: --smoke: the tiny checkpoint's rows, a few steps (figures mean nothing).
SMOKE_SETS = ["data.seq_len=128", "dpo.steps=3", "dpo.max_examples=60", "dpo.val_examples=8", "dpo.warmup_steps=1"]


def arm_config(ckpt: Path, kind: str, seed: int, data: Path | None = None, smoke: bool = False):
    """The config `lmforge dpo --set dpo.init=CKPT [the arm's --set] --set train.seed=SEED` trains
    with (no --config: the command's own defaults, loaded as the CLI loads them); the control arm
    trains on `data`, the same pairs with half the labels swapped. tests/test_bench_configs.py
    holds it equal to the command's."""
    from lmforge.config import load_config

    sets = [f"dpo.init={ckpt}", *ARMS[kind][0], f"train.seed={seed}"] + ([f"dpo.data={data}"] if data else [])
    return load_config(None, sets + (SMOKE_SETS if smoke else []))


@torch.no_grad()
def score(policy, reference, samples, seq_len: int, pad_id: int, runtime, kinds: list[str]) -> dict:
    """Held-out figures of `policy` against `reference` on rendered pairs `samples`."""
    policy.eval()
    reference.eval()
    right, reward_right, nats, tokens, n = 0, 0, 0.0, 0, 0
    per_kind = {k: [0, 0] for k in kinds}
    for b in pair_batches(samples, seq_len, 16, pad_id):
        with runtime.autocast():
            pc, pr = sequence_logps(policy, b)
            rc, rr = sequence_logps(reference, b)
        pc, pr, rc, rr = (x.float() for x in (pc, pr, rc, rr))
        ok = pc > pr
        right += int(ok.sum())
        reward_right += int(((pc - rc) > (pr - rr)).sum())
        nats -= float(pc.sum())
        tokens += int(b.completion_tokens[: b.n_pairs].sum())
        n += b.n_pairs
        for j, i in enumerate(b.pair_index.tolist()):
            kind = samples.mutations[i]
            per_kind[kind][0] += int(ok[j])
            per_kind[kind][1] += 1
    return {"pairwise_accuracy": right / n, "reward_accuracy": reward_right / n, "chosen_nats_per_token": nats / tokens,
            "per_kind": {k: v[0] / max(v[1], 1) for k, v in per_kind.items()},
            "per_kind_n": {k: v[1] for k, v in per_kind.items()}, "pairs": n}


def write_pairs(path: Path, records: list[dict], shuffle_seed: int | None) -> Path:
    rng = random.Random(shuffle_seed)
    lines = []
    for r in records:
        r = dict(r)
        if shuffle_seed is not None and rng.random() < 0.5:
            r["chosen"], r["rejected"] = r["rejected"], r["chosen"]
        lines.append(json.dumps(r) + "\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


def smoke_checkpoint(tmp: Path) -> Path:
    """A tiny pretrained + SFT model on the smoke corpus (seconds)."""
    from lmforge.config import load_config
    from lmforge.stages import pretrain_stage, prepare_stage, sft_stage

    common.smoke_tokenizer(tmp / "tok", 512)
    cfg = load_config(None, [f"tokenizer.dir={tmp / 'tok'}", f"data.source={common.smoke_corpus(tmp / 'corpus')}",
                             f"data.dir={tmp / 'data'}", "data.seq_len=128", "model.dim=64", "model.n_layers=2",
                             "model.n_heads=4", "model.n_kv_heads=2", "train.steps=10", "train.micro_batch_size=4",
                             "train.precision=fp32", "train.checkpoint_every=0", "train.eval_every=0",
                             "sft.steps=5", "sft.micro_batch_size=4", "sft.max_examples=60", "sft.val_examples=20"])
    prepare_stage(cfg, progress=False)
    pretrain_stage(cfg, tmp / "pre", progress=False)
    sft_stage(replace(cfg, sft=replace(cfg.sft, init=str(tmp / "pre"))), tmp / "sft", progress=False)
    return tmp / "sft"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=None, help=f"SFT checkpoint (default {DEFAULT_CHECKPOINT})")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--arms", default="full,lora,shuffled")
    common.smoke_flag(ap)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-dpo-") as tmp:
        tmp = Path(tmp)
        if args.smoke:
            ckpt, args.seeds = smoke_checkpoint(tmp), 1
        else:
            ckpt = args.checkpoint or DEFAULT_CHECKPOINT
            if not ckpt.exists():
                print(f"bench_dpo: skipped: no SFT checkpoint at {ckpt} (`make speedrun` writes one, or pass "
                      f"--checkpoint)")
                return {"skipped": f"no checkpoint at {ckpt}"}
        return run(ckpt, args, tmp)


def run(ckpt: Path, args, tmp: Path) -> dict:
    ckpt = resolve_checkpoint(ckpt)
    base_cfg, _ = read_checkpoint_meta(ckpt)
    sft, tok, _, _ = load_checkpoint(ckpt)
    runtime = training_runtime(base_cfg.train.precision, torch.device("cpu"))
    d = base_cfg.data
    stats = PairStats()
    records = stdlib_preference_pairs(d.val_fraction, seed=base_cfg.train.seed, max_chars=base_cfg.sft.max_chars,
                                      max_train=0 if not args.smoke else 60, include_tests=d.include_tests,
                                      stats=stats)
    val = render_pairs([pair_from_record(r, r["name"]) for r in records["val"]], tok, d.seq_len)
    kinds = sorted(set(val.mutations))
    print(f"pairs: {stats.as_dict()['pairs']}; held-out kinds {stats.as_dict()['kinds']['val']}; "
          f"{stats.no_site} functions without a site, {stats.unbalanced} skipped for balance")
    base = score(sft, sft, val, d.seq_len, tok.pad_id, runtime, kinds)
    results: dict[str, list[dict]] = {}
    for name in [a for a in args.arms.split(",") if a]:
        for seed in range(args.seeds):
            data = None
            if ARMS[name][1]:  # the control: the same training pairs, chosen and rejected swapped in half
                data = write_pairs(tmp / f"{name}-{seed}.jsonl", records["train"], 1000 + seed)
            cfg = arm_config(ckpt, name, base_cfg.train.seed + seed, data, args.smoke)
            t0 = time.perf_counter()
            last = dpo_stage(cfg, tmp / f"run-{name}-{seed}", progress=False)
            seconds = time.perf_counter() - t0
            tuned = load_checkpoint(tmp / f"run-{name}-{seed}", tok.folder)[0]
            r = score(tuned, sft, val, d.seq_len, tok.pad_id, runtime, kinds)
            r.update(seconds=seconds, train_loss=last["loss"], train_reward_accuracy=last["rewards/accuracies"])
            results.setdefault(name, []).append(r)
    print_table(base, results, kinds, args)
    return {"checkpoint": str(ckpt), "baseline": base, "arms": results,
            "machine": common.machine_line()}


def _mean(rows: list[dict], key: str, sub: str | None = None) -> str:
    vals = [r[key][sub] if sub else r[key] for r in rows]
    m = statistics.mean(vals)
    spread = f" ({min(vals):.0%}-{max(vals):.0%})" if len(vals) > 1 else ""
    return f"{m:.0%}{spread}"


def print_table(base: dict, results: dict, kinds: list[str], args) -> None:
    headers = ["model", "pairwise acc.", "reward acc.", "chosen nats/token (change)", "train s"] + kinds
    rows = [["SFT (baseline)", f"{base['pairwise_accuracy']:.0%}", "-", f"{base['chosen_nats_per_token']:.4f}", "-"]
            + [f"{base['per_kind'][k]:.0%}" for k in kinds]]
    for name, rs in results.items():
        loss = statistics.mean(r["chosen_nats_per_token"] for r in rs)
        rows.append([f"DPO {name}", _mean(rs, "pairwise_accuracy"), _mean(rs, "reward_accuracy"),
                     f"{loss:.4f} ({loss / base['chosen_nats_per_token'] - 1:+.1%})",
                     f"{statistics.mean(r['seconds'] for r in rs):.0f}"] + [_mean(rs, "per_kind", k) for k in kinds])
    print(common.table(headers, rows, title=f"lmforge dpo --set dpo.init=CKPT as docs/preference-tuning.md types it "
                                            f"(the default pairs), "
                                            f"{args.seeds} seed(s); held-out pairs per kind "
                                            f"{ {k: base['per_kind_n'][k] for k in kinds} }"
                                            + (" (SMOKE RUN: figures mean nothing)" if args.smoke else "")))


if __name__ == "__main__":
    main(sys.argv[1:])
