"""SFT rows: packed conversations against right-padded ones, each arm its own `lmforge sft`.

From a pretrained checkpoint (default: the speedrun's, runs/speedrun/pretrain), the speedrun's
SFT stage (its [sft] section of configs/stdlib-tiny.toml, 150 steps on 2,000 standard-library
conversations) runs once per arm and seed, as a user runs it: a fresh process, its wall clock
from start to exit (start-up, data, the compile where it is on — with an empty compile cache,
as on a fresh machine —, the steps, validation and the checkpoint). The arms:

- padded+compile: one conversation per row, 8 rows a step, `compile = true` (the recipe
  before issue 32);
- padded: the same without compile (what the compile alone gives);
- packed+compile: conversations packed with document masking (`sft.packing = true`), 4 rows a
  step: about the same conversations a step (2.1 a row on this data);
- packed: the recipe now (`sft.compile = false`).

Reported per arm (mean over the seeds, min-max): the held-out SFT loss (nats per supervised
token, the stage's own `val_loss`), the conversations' tokens trained per second of steps
(`tokens` x (1 - padding share) / the steps' seconds, padding excluded), the stage's wall
seconds and their ratio to the first arm. Goals (issue 32): held-out loss unchanged within the
seeds' spread, real tokens/s >= 1.8x and the stage <= 0.6x of "padded+compile".

`--stage dpo` does the same for `lmforge dpo` (its defaults: the embedded preference pairs,
8 pairs a micro-batch) from an SFT checkpoint (default runs/speedrun/sft): "padded" (each side
of a pair right-padded in a row of its own, `dpo.packing = false`, the layout before) against
"packed" (a micro-batch's sides packed with document masking: the same pairs a step). The
held-out figures are the stage's own `val_loss` (the DPO loss) and `val_pairwise_accuracy`.

    python bench/bench_sft.py [--init runs/speedrun/pretrain] [--seeds 1337,1,2] [--arms ...]
    python bench/bench_sft.py --stage dpo [--init runs/speedrun/sft]
    python bench/bench_sft.py --smoke [--stage dpo]   # a tiny model in seconds: proves it runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

#: name -> the --set overrides of the arm (on top of the recipe's [sft] section)
ARMS = {
    "padded+compile": ["sft.packing=false", "sft.micro_batch_size=8", "sft.compile=true"],
    "padded": ["sft.packing=false", "sft.micro_batch_size=8", "sft.compile=false"],
    "packed+compile": ["sft.packing=true", "sft.micro_batch_size=4", "sft.compile=true"],
    "packed": ["sft.packing=true", "sft.micro_batch_size=4", "sft.compile=false"],
}
DPO_ARMS = {"padded": ["dpo.packing=false"], "packed": ["dpo.packing=true"]}
STAGE_ARMS = {"sft": ARMS, "dpo": DPO_ARMS}
RECIPE = common.ROOT / "configs" / "stdlib-tiny.toml"
DEFAULT_INIT = {"sft": common.ROOT / "runs" / "speedrun" / "pretrain", "dpo": common.ROOT / "runs" / "speedrun" / "sft"}
SMOKE_SETS = {"sft": ["sft.steps=3", "sft.max_examples=24", "sft.val_examples=8", "sft.warmup_steps=1",
                      "data.seq_len=128"],
              "dpo": ["dpo.steps=3", "dpo.max_examples=24", "dpo.val_examples=8", "dpo.warmup_steps=1",
                      "data.seq_len=128"]}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_arm(name: str, sets: list[str], seed: int, init: Path, out: Path, extra: list[str],
            stage: str = "sft") -> dict:
    """One `lmforge sft` (or dpo) process; its figures from the run folder's metrics and
    {stage}_data.json."""
    argv = [sys.executable, "-m", "lmforge", stage, "--config", str(RECIPE), "--out", str(out), "--no-progress",
            "--set", f"{stage}.init={init}", "--set", f"train.seed={seed}"]
    for s in sets + extra:
        argv += ["--set", s]
    t0 = time.perf_counter()
    # a cold compile cache per process: the first run on a machine, as the speedrun's goal counts it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(common.ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "TORCHINDUCTOR_CACHE_DIR": str(out.parent / f"inductor-{out.name}")}
    res = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"bench_sft: {stage} arm {name!r} seed {seed} failed ({res.returncode}):\n"
                         f"{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    data = json.loads((out / f"{stage}_data.json").read_text())
    last = rows[-1]
    steps_s = last["elapsed_s"]
    steady = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows[1:], rows[2:])]  # after the first step
    real = last["tokens"] * (1.0 - data["padding_fraction"])
    return {"arm": name, "seed": seed, "val_loss": last["val_loss"], "wall_s": wall, "steps_s": steps_s,
            "first_step_s": rows[0]["elapsed_s"], "median_step_s": statistics.median(steady) if steady else steps_s,
            "padding": data["padding_fraction"], "real_tokens": real, "real_tokens_per_s": real / steps_s,
            "supervised": last["supervised"], "steps": last["step"],
            "val_pairwise_accuracy": last.get("val_pairwise_accuracy")}


def mean_spread(xs: list[float], fmt: str) -> str:
    m = statistics.fmean(xs)
    return fmt.format(m) + (f" ({fmt.format(min(xs))}-{fmt.format(max(xs))})" if len(xs) > 1 else "")


def summarize(results: list[dict], arms: list[str]) -> tuple[str, dict]:
    base = [r for r in results if r["arm"] == arms[0]]
    base_wall = statistics.fmean(r["wall_s"] for r in base)
    base_rate = statistics.fmean(r["real_tokens_per_s"] for r in base)
    rows, summary = [], {}
    for arm in arms:
        rs = [r for r in results if r["arm"] == arm]
        wall = statistics.fmean(r["wall_s"] for r in rs)
        rate = statistics.fmean(r["real_tokens_per_s"] for r in rs)
        summary[arm] = {"val_loss": statistics.fmean(r["val_loss"] for r in rs), "wall_s": wall,
                        "real_tokens_per_s": rate, "wall_ratio": wall / base_wall, "rate_ratio": rate / base_rate,
                        "padding": rs[0]["padding"], "seeds": [r["seed"] for r in rs]}
        held_out = mean_spread([r["val_loss"] for r in rs], "{:.4f}")
        if rs[0]["val_pairwise_accuracy"] is not None:
            held_out += " / acc " + mean_spread([r["val_pairwise_accuracy"] for r in rs], "{:.3f}")
        rows.append([arm, f"{rs[0]['padding']:.1%}", held_out,
                     f"{statistics.fmean(r['supervised'] for r in rs):,.0f}",
                     mean_spread([r["median_step_s"] for r in rs], "{:.3f}"),
                     mean_spread([r["first_step_s"] for r in rs], "{:.1f}"),
                     mean_spread([r["real_tokens_per_s"] for r in rs], "{:,.0f}"), f"{rate / base_rate:.2f}x",
                     mean_spread([r["wall_s"] for r in rs], "{:.1f}"), f"{wall / base_wall:.2f}x"])
    text = common.table(["arm", "padding", "held-out loss (nats)", "supervised (targets or pairs)", "step s (median)",
                         "first step s", "real tokens/s of steps", "ratio", "stage wall s", "ratio"], rows)
    return text, summary


def smoke_init(tmp: Path, stage: str) -> tuple[Path, list[str]]:
    """A tiny pretrained checkpoint on the smoke corpus (SFT'd for --stage dpo) and the --set
    lines that fit it."""
    from dataclasses import replace

    from lmforge.config import load_config
    from lmforge.stages import prepare_stage, pretrain_stage, sft_stage

    common.smoke_tokenizer(tmp / "tok", 512)
    sets = [f"tokenizer.dir={tmp / 'tok'}", f"data.source={common.smoke_corpus(tmp / 'corpus')}",
            f"data.dir={tmp / 'data'}", "data.seq_len=128", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
            "model.n_kv_heads=2", "train.steps=3", "train.micro_batch_size=4", "train.precision=fp32",
            "train.checkpoint_every=0", "train.eval_every=0", "train.compile=false", "train.time_budget_s=0"]
    cfg = load_config(RECIPE, sets)
    prepare_stage(cfg, progress=False)
    pretrain_stage(cfg, tmp / "pre", progress=False)
    init = tmp / "pre"
    if stage == "dpo":
        cfg = load_config(RECIPE, sets + SMOKE_SETS["sft"])
        sft_stage(replace(cfg, sft=replace(cfg.sft, init=str(init))), tmp / "sft", progress=False)
        init = tmp / "sft"
    return init, [f"tokenizer.dir={tmp / 'tok'}", "train.precision=fp32"] + SMOKE_SETS[stage]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", choices=sorted(STAGE_ARMS), default="sft", help="the stage whose rows are compared")
    ap.add_argument("--init", type=Path, default=None,
                    help=f"the checkpoint the stage starts from (default {DEFAULT_INIT})")
    ap.add_argument("--seeds", default="1337,1,2", help="comma-separated train.seed values, one run per arm each")
    ap.add_argument("--arms", default="", help=f"comma-separated, the first is the baseline (default: all of the "
                                               f"stage's): {{stage: arms}} = { {k: list(v) for k, v in STAGE_ARMS.items()} }")
    common.smoke_flag(ap)
    args = ap.parse_args(argv)
    stage, arm_sets = args.stage, STAGE_ARMS[args.stage]
    arms = [a.strip() for a in (args.arms or ",".join(arm_sets)).split(",") if a.strip()]
    unknown = [a for a in arms if a not in arm_sets]
    if unknown:
        ap.error(f"--arms: unknown {unknown}; expected some of {list(arm_sets)}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-sft-") as tmp:
        tmp = Path(tmp)
        extra: list[str] = []
        init = args.init or DEFAULT_INIT[stage]
        if args.smoke:
            init, extra = smoke_init(tmp, stage)
            seeds, arms = seeds[:1], [a for a in arms if "compile" not in a] or arms[:1]  # no compile: seconds
        elif not (init.is_dir()):
            print(f"bench_sft: {init} does not exist; `make speedrun` writes it (or pass --init). Skipped.")
            return {}
        results = []
        for seed in seeds:
            for i, arm in enumerate(arms if seed % 2 == 0 else arms[::-1]):  # alternate the order per seed
                r = run_arm(arm, arm_sets[arm], seed, init, tmp / f"{arm.replace('+', '-')}-{seed}", extra, stage)
                log(f"bench_sft: seed {seed} {arm}: val_loss {r['val_loss']:.4f}, wall {r['wall_s']:.1f}s, "
                    f"steps {r['steps_s']:.1f}s, real tokens/s {r['real_tokens_per_s']:,.0f}")
                results.append(r)
    text, summary = summarize(results, arms)
    title = (f"### {stage.upper()} rows: packed against padded (`python bench/bench_sft.py --stage {stage}`; "
             f"{common.machine_line()}; "
             f"seeds {','.join(map(str, seeds))})" + (" (SMOKE RUN: figures mean nothing)" if args.smoke else ""))
    print(title + "\n\n" + text)
    out = {"benchmark": stage, "machine": common.machine(), "results": results, "summary": summary}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
