"""`lmforge speedrun`: every stage in order in one output folder, then a summary.

    OUT/tokenizer   train-tokenizer
    OUT/data        prepare
    OUT/pretrain    pretrain (checkpoints, metrics.jsonl)
    OUT/sft         SFT on the standard-library function set, from pretrain's checkpoint
    OUT/sft_samples.json   greedy bodies for held-out prompts, and whether each parses
    OUT/loss.png    training and validation loss against tokens seen
    OUT/summary.json, OUT/summary.md   the table printed at the end

With `resume=True` finished stages are kept and pretraining continues from its newest
checkpoint, so an interrupted speedrun picks up where it stopped.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from lmforge.config import Config
from lmforge.contract import CONTRACT_FILE
from lmforge.data.shards import Shard
from lmforge.errors import ConfigError
from lmforge.evaluate import evaluate_shard, split_texts, xz_bits_per_byte
from lmforge.generate import SamplingConfig
from lmforge.stages import generate_text, log, prepare_stage, pretrain_stage, train_tokenizer_stage
from lmforge.tokenizer import Tokenizer
from lmforge.train.checkpoint import load_model
from lmforge.train.trainer import METRICS_FILE, resolve_precision

SAMPLE_PROMPTS = ("def ", "import os\n", "class ")


def plot_loss(run_dir: Path, out: Path) -> Path | None:
    """loss.png: training loss (and validation loss where measured) against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines() if line.strip()]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot([r["tokens"] for r in rows], [r["loss"] for r in rows], lw=1, label="train loss")
    val = [(r["tokens"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), "o-", ms=4, label="validation loss")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats/token)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    ax.set_title("lmforge speedrun")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def speedrun(cfg: Config, out: str | Path, resume: bool = False, progress: bool = True) -> dict:
    """Run tokenizer -> prepare -> pretrain -> eval -> samples -> sft in `out`; return the summary."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not resume:
        raise ConfigError(f"--out {out} is not empty. Pass --resume to continue that speedrun, or choose another --out.")
    out.mkdir(parents=True, exist_ok=True)
    cfg = replace(cfg, tokenizer=replace(cfg.tokenizer, dir=str(out / "tokenizer")),
                  data=replace(cfg.data, dir=str(out / "data")))
    times: dict[str, float] = {}

    t0 = time.perf_counter()
    if resume and (out / "tokenizer" / CONTRACT_FILE).is_file():
        log("speedrun: tokenizer already trained, kept")
    else:
        log("== 1/5 train-tokenizer")
        train_tokenizer_stage(cfg, progress=progress)
    times["tokenizer"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    if resume and (out / "data" / CONTRACT_FILE).is_file():
        log("speedrun: data already prepared, kept")
    else:
        log("== 2/5 prepare")
        prepare_stage(cfg, progress=progress)
    times["prepare"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    log("== 3/5 pretrain")
    run_dir = out / "pretrain"
    last = pretrain_stage(cfg, run_dir, resume=resume, progress=progress)
    if last.get("interrupted"):
        raise KeyboardInterrupt  # the checkpoint is written; `speedrun --resume` continues
    times["pretrain"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    log("== 4/5 evaluate and sample")
    model, _, contract, ckpt_path = load_model(run_dir)
    tok = Tokenizer.load(ckpt_path)
    val = Shard.open(cfg.data.dir, "val", contract, ckpt_path / CONTRACT_FILE)
    dtype = resolve_precision(cfg.train.precision, torch.device("cpu"))
    res = evaluate_shard(model, val, cfg.data.seq_len, cfg.train.micro_batch_size, "cpu", dtype,
                         cfg.data.document_masking)
    xz = xz_bits_per_byte(split_texts(val, tok))
    g = cfg.generate
    sampling = SamplingConfig.from_config(g, max_new_tokens=min(g.max_new_tokens, 96))
    samples = [generate_text(model, tok, p, sampling, seed=cfg.train.seed + i) for i, p in enumerate(SAMPLE_PROMPTS)]
    plot = plot_loss(run_dir, out / "loss.png")
    times["eval"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    sft_summary = sft_speedrun(cfg, out, ckpt_path, resume, progress)
    times["sft"] = time.perf_counter() - t0

    rows = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines() if line.strip()]
    train_time = rows[-1]["elapsed_s"] if rows else 0.0
    summary = {
        "parameters": model.num_parameters(),
        "non_embedding_parameters": model.num_parameters(non_embedding=True),
        "tokens_trained": rows[-1]["tokens"] if rows else 0,
        "tokens_per_s": (rows[-1]["tokens"] / train_time) if rows and train_time else 0.0,
        "train_seconds": train_time,
        "stage_seconds": {k: round(v, 1) for k, v in times.items()},
        "val_loss": res["loss"],
        "val_perplexity": res["perplexity"],
        "val_bits_per_byte": res["bits_per_byte"],
        "xz_bits_per_byte": xz,
        "val_tokens": res["tokens"],
        "val_bytes": res["bytes"],
        "final_train_loss": last.get("loss"),
        "checkpoint": str(ckpt_path),
        "loss_plot": str(plot) if plot else None,
        "samples": samples,
        **sft_summary,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    table = format_summary(summary)
    (out / "summary.md").write_text(table + "\n", encoding="utf-8")
    print(table, flush=True)
    return summary


def format_summary(s: dict) -> str:
    st = s["stage_seconds"]
    rows = [
        ("parameters", f"{s['parameters']:,} ({s['non_embedding_parameters']:,} non-embedding)"),
        ("tokens trained", f"{s['tokens_trained']:,}"),
        ("training throughput", f"{s['tokens_per_s']:,.0f} tokens/s"),
        ("wall time per stage", ", ".join(f"{k} {v:.0f}s" for k, v in st.items())),
        ("held-out loss", f"{s['val_loss']:.4f} nats/token (perplexity {s['val_perplexity']:.2f})"),
        ("held-out bits per byte", f"{s['val_bits_per_byte']:.4f}"),
        ("xz -9e bits per byte (same text)", f"{s['xz_bits_per_byte']:.4f}"),
        *sft_rows(s),
        ("loss curve", s["loss_plot"] or "-"),
        ("checkpoint", s["checkpoint"]),
    ]
    w = max(len(k) for k, _ in rows)
    lines = ["", "## lmforge speedrun", "", f"| {'what'.ljust(w)} | value |", f"|{'-' * (w + 2)}|-------|"]
    lines += [f"| {k.ljust(w)} | {v} |" for k, v in rows]
    for i, text in enumerate(s["samples"], 1):
        lines += ["", f"### sample {i}", "```python", text.rstrip(), "```"]
    return "\n".join(lines)


# -- stage 5: supervised fine-tuning -----------------------------------------------------------
SFT_EVAL_PROMPTS = 64
SFT_EVAL_MAX_NEW_TOKENS = 160


def sft_speedrun(cfg: Config, out: Path, init: Path, resume: bool = False, progress: bool = True) -> dict:
    """SFT from the pretrained checkpoint `init` on the standard-library function set (the
    [sft] keys of `cfg`; sft.data is forced to "stdlib"), into OUT/sft. Then, on held-out
    modules: the SFT validation loss (nats per supervised token) and the fraction of greedy
    bodies (at most SFT_EVAL_MAX_NEW_TOKENS tokens, for SFT_EVAL_PROMPTS prompts whose
    reference body fits in that budget) that parse with ast.parse under their signature.
    The bodies go to OUT/sft_samples.json."""
    from lmforge.sft import SFT_DATA_FILE, SFT_VAL_FILE, body_parse_rate, held_out_prompts, sft_stage

    log("== 5/5 sft")
    run_dir = out / "sft"
    scfg = replace(cfg, sft=replace(cfg.sft, init=str(init), data="stdlib"))
    last = sft_stage(scfg, run_dir, resume=resume, progress=progress)
    if last.get("interrupted"):
        raise KeyboardInterrupt  # the checkpoint is written; `speedrun --resume` continues
    rows = [json.loads(x) for x in (run_dir / METRICS_FILE).read_text().splitlines() if x.strip()]
    val_loss = last.get("val_loss")
    if val_loss is None:  # a resumed run that had already finished: its last validation
        val_loss = next((r["val_loss"] for r in reversed(rows) if r.get("val_loss") is not None), None)
    model, _, _, ckpt_path = load_model(run_dir)
    tok = Tokenizer.load(ckpt_path)
    items = held_out_prompts(run_dir / SFT_VAL_FILE, tok, SFT_EVAL_PROMPTS, SFT_EVAL_MAX_NEW_TOKENS - 1)
    parse = body_parse_rate(model, tok, items, SFT_EVAL_MAX_NEW_TOKENS)
    from lmforge.sft_checks import doctest_pass_rate

    parse["doctests"] = doctest_pass_rate(items, parse["examples"])
    (out / "sft_samples.json").write_text(json.dumps(parse, indent=2) + "\n", encoding="utf-8")
    data = json.loads((run_dir / SFT_DATA_FILE).read_text(encoding="utf-8"))
    shown = f"{val_loss:.4f}" if val_loss is not None else "-"
    log(f"sft: validation loss {shown} nats/token; {parse['parsed']}/{parse['n']} generated bodies end their "
        f"turn and parse ({parse['stopped']} ended their turn)")
    return {
        "sft_val_loss": val_loss,
        "sft_final_train_loss": rows[-1]["loss"] if rows else None,
        "sft_steps": rows[-1]["step"] if rows else 0,
        "sft_train_seconds": rows[-1]["elapsed_s"] if rows else 0.0,
        "sft_data": data["splits"],
        "sft_parse_fraction": parse["fraction"],
        "sft_parse_n": parse["n"],
        "sft_stopped": parse["stopped"],
        "sft_im_end": parse["im_end"],
        "sft_parse_and_im_end_fraction": parse["parsed_and_im_end"] / max(1, parse["n"]),
        "sft_doctest_passed": parse["doctests"]["passed"],
        "sft_doctest_n": parse["doctests"]["n"],
        "sft_checkpoint": str(ckpt_path),
    }


def sft_rows(s: dict) -> list[tuple[str, str]]:
    """The SFT lines of the summary table (none for a summary without SFT)."""
    if "sft_val_loss" not in s:
        return []
    tr = s["sft_data"]["train"]
    return [
        ("SFT data (stdlib functions)", f"{tr['kept']:,} conversations ({tr['truncated']} truncated, "
                                        f"{tr['dropped_all_cut']} dropped), {s['sft_steps']} steps"),
        ("SFT held-out loss", f"{s['sft_val_loss']:.4f} nats/supervised token" if s["sft_val_loss"] is not None
         else "-"),
        ("SFT bodies that parse", f"{s['sft_parse_fraction']:.0%} of {s['sft_parse_n']} held-out prompts "
                                  f"(greedy, ended with <|im_end|> within {SFT_EVAL_MAX_NEW_TOKENS} tokens: "
                                  f"{s['sft_stopped']})"),
        ("SFT bodies that parse and end with <|im_end|>",
         f"{s.get('sft_parse_and_im_end_fraction', float('nan')):.0%} (<|im_end|>: {s.get('sft_im_end', '-')} of "
         f"{s['sft_parse_n']})"),
        ("SFT docstring examples (>>>) passed", f"{s.get('sft_doctest_passed', '-')} of {s.get('sft_doctest_n', '-')} "
                                                f"functions whose reference passes them"),
    ]
