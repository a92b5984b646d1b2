"""LoRA against full fine-tuning: SFT's held-out loss, trainable share, step time, peak memory.

From a pretrained checkpoint (default: the speedrun's, runs/speedrun/pretrain), the speedrun's
SFT (the [sft] section of its config: the standard-library functions, same steps, batch and
seed) twice, side by side in one run: every weight (full) and LoRA adapters (rank 16 on every
linear layer of the blocks, AdamW at `--lora-lr`). Each arm is its own `lmforge sft` process
(so its peak resident memory is its own) and the arms alternate, `--repeat` times. Then the
same on the model imported from Hugging Face: the checkpoint exported (`lmforge export`),
loaded and saved again by `transformers` itself (`save_pretrained`), then `lmforge import-hf`.

Per arm: the held-out SFT loss (nats per supervised token, the last validation), its ratio to
full SFT's (goal: within 3%), the trainable parameters' share (goal: at most 5%), the median
step time over the steps after the first 5 (goal: no slower than full), and the process's
peak RSS (goal: less).

Run: `python bench/bench_lora.py [--checkpoint DIR] [--repeat 1] [--no-imported]`. Skipped (a
note, exit 0) without the checkpoint (`make speedrun` writes it).
`--smoke`: a tiny model trained in seconds (figures mean nothing; proves the benchmark runs).
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

import common

DEFAULT_CHECKPOINT = common.ROOT / "runs" / "speedrun" / "pretrain"

#: runs `lmforge` in this process and prints its peak RSS (MB) last, on stderr
PEAK = ("import resource, sys; from lmforge.cli import main\n"
        "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
        "print('peak_rss_mb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, file=sys.stderr)\n"
        "sys.exit(code or 0)\n")


def lmforge(args: list[str], log) -> tuple[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(common.ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", PEAK, *args], capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"lmforge {' '.join(args)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    peak = float(res.stderr.strip().splitlines()[-1].split()[-1])
    return res.stderr, peak


def sft_arm(init: Path, tok_dir: Path | None, out: Path, rank: int, lr: float | None, extra: list[str], log) -> dict:
    sets = ["--set", f"sft.init={init}", "--set", "train.checkpoint_every=0", "--set", "train.keep_last=1"] + extra
    if tok_dir is not None:
        sets += ["--set", f"tokenizer.dir={tok_dir}"]
    if rank:
        sets += ["--set", f"lora.rank={rank}"]
    if lr is not None:
        sets += ["--set", f"sft.lr={lr}"]
    stderr, peak = lmforge(["sft", "--out", str(out), "--no-progress", *sets], log)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_s = [r["elapsed_s"] - p["elapsed_s"] for p, r in zip(rows, rows[1:])][5:] or [rows[-1]["elapsed_s"]]
    val = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    trainable = total = None
    for line in stderr.splitlines():
        if "trainable parameters of" in line:
            part = line.split(": ")[-1]
            trainable = int(part.split(" trainable")[0].replace(",", ""))
            total = int(part.split("parameters of ")[1].split(";")[0].replace(",", ""))
        elif line.startswith("model: dim") and total is None:
            total = int(line.split(" parameters")[0].split(", ")[-1].replace(",", ""))
    return {"val_loss": val[-1], "step_s": statistics.median(step_s), "peak_rss_mb": peak,
            "trainable": trainable if rank else total, "total": total, "steps": rows[-1]["step"]}


def imported(ckpt: Path, tmp: Path, log) -> tuple[Path, Path]:
    """The checkpoint through Hugging Face: export, transformers' own save_pretrained, import-hf."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lmforge(["export", "--checkpoint", str(ckpt), "--out", str(tmp / "hf-export")], log)
    model = AutoModelForCausalLM.from_pretrained(str(tmp / "hf-export"))
    model.save_pretrained(str(tmp / "hf"))
    AutoTokenizer.from_pretrained(str(tmp / "hf-export")).save_pretrained(str(tmp / "hf"))
    lmforge(["import-hf", str(tmp / "hf"), "--out", str(tmp / "imported")], log)
    return tmp / "imported", tmp / "imported"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=None, help=f"pretrained checkpoint (default {DEFAULT_CHECKPOINT})")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lora-lr", type=float, default=None, help="LoRA's sft.lr (default: the config's)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--no-imported", action="store_true")
    common.smoke_flag(ap)
    args = ap.parse_args(argv)
    log = print
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-lora-") as tmp:
        tmp = Path(tmp)
        extra: list[str] = []
        if args.smoke:
            sys.path.insert(0, str(common.ROOT / "bench"))
            from bench_dpo import smoke_checkpoint

            ckpt = smoke_checkpoint(tmp / "smoke").parent / "pre"
            extra = ["--set", "sft.steps=8", "--set", "sft.micro_batch_size=4", "--set", "sft.max_examples=40",
                     "--set", "sft.val_examples=10", "--set", "train.precision=fp32"]
        else:
            ckpt = args.checkpoint or DEFAULT_CHECKPOINT
            if not ckpt.exists():
                print(f"bench_lora: skipped: no pretrained checkpoint at {ckpt} (`make speedrun` writes one, or pass "
                      f"--checkpoint)")
                return {"skipped": f"no checkpoint at {ckpt}"}
        bases = {"lmforge": (ckpt, None)}
        if not args.no_imported:
            bases["imported"] = imported(ckpt, tmp, log)
        results: dict[str, dict[str, list[dict]]] = {}
        for base, (init, tok_dir) in bases.items():
            for r in range(args.repeat):
                for arm, rank, lr in (("full", 0, None), ("lora", args.rank, args.lora_lr)):
                    res = sft_arm(init, tok_dir, tmp / f"{base}-{arm}-{r}", rank, lr, extra, log)
                    results.setdefault(base, {}).setdefault(arm, []).append(res)
        rows = []
        for base, arms in results.items():
            full = arms["full"]
            f_loss = statistics.mean(x["val_loss"] for x in full)
            f_step = statistics.median(x["step_s"] for x in full)
            f_rss = statistics.median(x["peak_rss_mb"] for x in full)
            for arm, xs in arms.items():
                loss = statistics.mean(x["val_loss"] for x in xs)
                step = statistics.median(x["step_s"] for x in xs)
                rss = statistics.median(x["peak_rss_mb"] for x in xs)
                share = xs[0]["trainable"] / xs[0]["total"] if xs[0]["trainable"] and xs[0]["total"] else float("nan")
                rows.append([base, arm, f"{loss:.4f}", f"{loss / f_loss:.3f}x (goal <= 1.03)", f"{share:.1%}",
                             f"{step:.3f} ({step / f_step:.2f}x)", f"{rss:,.0f} ({rss / f_rss:.2f}x)"])
        print(common.table(["base", "arm", "held-out SFT loss", "vs full", "trainable", "s/step (vs full)",
                            "peak RSS MB (vs full)"], rows,
                           title=f"LoRA rank {args.rank} vs full SFT, {args.repeat} run(s) each; {common.machine_line()}"
                                 + (" (SMOKE RUN: figures mean nothing)" if args.smoke else "")))
        return {"results": results, "rank": args.rank, "lora_lr": args.lora_lr}


if __name__ == "__main__":
    main(sys.argv[1:])
