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
import signal
import time
from dataclasses import replace
from pathlib import Path


from lmforge.config import Config, SamplingConfig
from lmforge.contract import CONTRACT_FILE
from lmforge.data.shards import Shard
from lmforge.data.inputs import source_path
from lmforge.evals.suite import results_table
from lmforge.scorers import body_parse_rate, doctest_pass_rate, held_out_prompts
from lmforge.errors import ConfigError, Interrupted
from lmforge.evaluate import evaluate_shard, split_texts, xz_bits_per_byte
from lmforge.fileio import (atomic_file, check_not_input, check_output, open_run_dir, read_marker, write_json,
                            write_text)
from lmforge.loading import load_checkpoint
from lmforge.runtime import Runtime, decode_runtime, training_runtime
from lmforge.stages.common import log
from lmforge.stages.generate import generate_text
from lmforge.stages.prepare import prepare_stage
from lmforge.stages.pretrain import pretrain_stage
from lmforge.stages.sft import SFT_DATA_FILE, SFT_VAL_FILE, sft_stage
from lmforge.stages.tokenizer import train_tokenizer_stage
from lmforge.train.trainer import METRICS_FILE

SAMPLE_PROMPTS = ("def ", "import os\n", "class ")
SPEEDRUN_OUTPUT = "speedrun"
STAGE_FOLDERS = ("tokenizer", "data", "pretrain", "sft")


def has_stage_output(out: Path) -> bool:
    """Whether a stage of the speedrun in `out` has written its folder (then only --resume reopens it)."""
    return any((out / name).exists() for name in STAGE_FOLDERS)


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
    try:
        with atomic_file(out) as tmp:  # the one writer: no half-written plot after a full disk
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)
    return out


def speedrun_stage(cfg: Config, out: str | Path, resume: bool = False, progress: bool = True) -> dict:
    """Run tokenizer -> prepare -> pretrain -> eval -> samples -> sft in `out`; return the summary.

    Raises:
        ConfigError: data.sources set (the speedrun scores the held-out split of one corpus).
        OutputError: `out` is, holds or lies inside data.source or a train.eval_tasks file (it
            writes its tokenizer, data and runs there), or is another command's output.
    """
    out = _open_output(cfg, out, resume)
    cfg = replace(cfg, tokenizer=replace(cfg.tokenizer, dir=str(out / "tokenizer")),
                  data=replace(cfg.data, dir=str(out / "data")))
    times: dict[str, float] = {}
    # decided once: the held-out loss is scored as training computes it, samples and SFT bodies
    # are decoded as `lmforge generate` decodes (pretrain and sft decide their own, as commands)
    score_rt, decode_rt = training_runtime(cfg.train.precision), decode_runtime()
    _tokenizer_and_data(cfg, out, resume, progress, times)

    t0 = time.perf_counter()
    log("== 3/5 pretrain")
    run_dir = out / "pretrain"
    last = pretrain_stage(cfg, run_dir, resume=resume, progress=progress)
    if last.get("interrupted"):  # the checkpoint is written; `speedrun --resume` continues
        raise Interrupted(last.get("signal", signal.SIGINT))
    times["pretrain"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    log("== 4/5 evaluate and sample")
    model, ckpt_path, scored = _evaluate_and_sample(cfg, out, run_dir, score_rt, decode_rt)
    times["eval"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    sft_summary = sft_speedrun(cfg, out, ckpt_path, decode_rt, resume, progress)
    times["sft"] = time.perf_counter() - t0

    summary = _summary(model, run_dir, times, scored, last, ckpt_path, sft_summary)
    write_json(out / "summary.json", summary)
    table = format_summary(summary)
    write_text(out / "summary.md", table + "\n")
    print(table, flush=True)
    return summary


def _open_output(cfg: Config, out: str | Path, resume: bool) -> Path:
    """The speedrun's folder, checked (one corpus; not an input) and opened (`fileio.open_run_dir`)."""
    if cfg.data.sources:
        raise ConfigError(f"data.sources lists {len(cfg.data.sources)} sources, but the speedrun scores the "
                          f"held-out split of one corpus (data.source) in its summary. Run a mixture with "
                          f"`lmforge prepare` and `lmforge pretrain` (docs/data.md: your own corpus), or remove "
                          f"data.sources.")
    # never an input: not inside the corpus (its stages' folders would join it), never holding it or a task file
    inputs = [("data.source", source_path(cfg.data.source)),
              *(("train.eval_tasks", str(t)) for t in cfg.train.eval_tasks if str(t).endswith((".jsonl", ".parquet")))]
    check_not_input(out, inputs, own_check=lambda: check_output(Path(out), SPEEDRUN_OUTPUT))
    # absent, empty, or an earlier speedrun (which needs --resume once a stage wrote into it): nothing else is touched
    return open_run_dir(out, SPEEDRUN_OUTPUT, resume, has_stage_output)


def _tokenizer_and_data(cfg: Config, out: Path, resume: bool, progress: bool, times: dict[str, float]) -> None:
    """Stages 1 and 2 (train-tokenizer, prepare), each timed into `times` (seconds, by marker)."""
    # (step, command, folder, its marker = its key in times): what an earlier run finished is kept on --resume
    for step, command, folder, marker, stage in ((1, "train-tokenizer", "tokenizer", "tokenizer", train_tokenizer_stage),
                                                 (2, "prepare", "data", "prepare", prepare_stage)):
        t0 = time.perf_counter()
        if resume and (read_marker(out / folder) or {}).get("command") == marker:
            log(f"speedrun: {out / folder} already written by `{command}`, kept")
        else:
            log(f"== {step}/5 {command}")
            stage(cfg, progress=progress)
        times[marker] = time.perf_counter() - t0


def _evaluate_and_sample(cfg: Config, out: Path, run_dir: Path, score_rt: Runtime, decode_rt: Runtime):
    """Stage 4 on pretrain's newest checkpoint: (model, its path, {"val": evaluate_shard's figures,
    "xz": xz bits per byte of the same text, "samples", "plot": loss.png or None, "suite"})."""
    model, tok, _, ckpt_path = load_checkpoint(run_dir, device=score_rt.device)
    val = Shard.open(cfg.data.dir, "val", tok.contract, ckpt_path / CONTRACT_FILE)
    res = evaluate_shard(model, val, cfg.data.seq_len, cfg.train.micro_batch_size or 16, score_rt,
                         cfg.data.document_masking)
    xz = xz_bits_per_byte(split_texts(val, tok))
    g = cfg.generate
    sampling = g.override(max_new_tokens=min(g.max_new_tokens, 96))
    model.to(decode_rt.device)
    samples = [generate_text(model, tok, p, sampling, seed=cfg.train.seed + i, runtime=decode_rt)
               for i, p in enumerate(SAMPLE_PROMPTS)]
    plot = plot_loss(run_dir, out / "loss.png")
    suite = evaluation_suite(model, tok, cfg, score_rt.device)
    return model, ckpt_path, {"val": res, "xz": xz, "samples": samples, "plot": plot, "suite": suite}


def _summary(model, run_dir: Path, times: dict[str, float], scored: dict, last: dict, ckpt_path: Path,
             sft_summary: dict) -> dict:
    """summary.json: the model's size, pretraining's throughput (metrics.jsonl), the stages' seconds,
    `scored` (`_evaluate_and_sample`), pretraining's last step `last`, and `sft_summary`."""
    rows = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines() if line.strip()]
    train_time = rows[-1]["elapsed_s"] if rows else 0.0
    res, plot = scored["val"], scored["plot"]
    return {
        "parameters": model.num_parameters(),
        "non_embedding_parameters": model.num_parameters(non_embedding=True),
        "tokens_trained": rows[-1]["tokens"] if rows else 0,
        "tokens_per_s": (rows[-1]["tokens"] / train_time) if rows and train_time else 0.0,
        "train_seconds": train_time,
        "stage_seconds": {k: round(v, 1) for k, v in times.items()},
        "val_loss": res["loss"],
        "val_perplexity": res["perplexity"],
        "val_bits_per_byte": res["bits_per_byte"],
        "xz_bits_per_byte": scored["xz"],
        "val_tokens": res["tokens"],
        "val_bytes": res["bytes"],
        "final_train_loss": last.get("loss"),
        "pretrain_health": (last.get("health") or {}).get("verdict", "-"),
        "checkpoint": str(ckpt_path),
        "loss_plot": str(plot) if plot else None,
        "samples": scored["samples"],
        "suite": scored["suite"],
        **sft_summary,
    }


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
        *([("evaluation suite (mean centred score)", f"{s['suite']['suite']:+.3f} (0 = chance, 1 = perfect; table below)")]
          if s.get("suite") else []),
        *sft_rows(s),
        ("training health (lmforge.train.health)", f"pretrain: {s.get('pretrain_health', '-')}; "
                                                    f"sft: {s.get('sft_health', '-')}"),
        ("loss curve", s["loss_plot"] or "-"),
        ("checkpoint", s["checkpoint"]),
    ]
    w = max(len(k) for k, _ in rows)
    lines = ["", "## lmforge speedrun", "", f"| {'what'.ljust(w)} | value |", f"|{'-' * (w + 2)}|-------|"]
    lines += [f"| {k.ljust(w)} | {v} |" for k, v in rows]
    if s.get("suite"):
        lines += ["", f"### evaluation suite of the pretrained model (`lmforge eval --tasks builtin --limit {SUITE_LIMIT}`)",
                  "", results_table(s["suite"])]
    for i, text in enumerate(s["samples"], 1):
        lines += ["", f"### sample {i}", "```python", text.rstrip(), "```"]
    return "\n".join(lines)


#: Items a task of the speedrun's evaluation suite (about 30 s on 2 cores for the four tasks).
SUITE_LIMIT = 200


def evaluation_suite(model, tok, cfg: Config, device) -> dict:
    """The built-in evaluation suite (lmforge.evals) of the pretrained model, fp32, seed 0: the
    same figures `lmforge eval --checkpoint OUT/pretrain --tasks builtin --limit SUITE_LIMIT` gives."""
    import torch

    from lmforge.evals.resolve import fit_tasks, resolve_tasks
    from lmforge.evals.suite import run_suite

    tasks = fit_tasks(resolve_tasks("builtin", cfg, 0, SUITE_LIMIT, tok), tok, model.config.max_seq_len)
    was = next(model.parameters()).device
    model = model.to(device=device, dtype=torch.float32).eval()
    res = run_suite(model, tok, tasks, device=device)
    model.to(was)
    return res


# -- stage 5: supervised fine-tuning -----------------------------------------------------------
SFT_EVAL_PROMPTS = 64
SFT_EVAL_MAX_NEW_TOKENS = 160
#: The SFT bodies' decoding policy: greedy with CTRL's repetition penalty (Keskar et al. 2019,
#: arXiv 1909.05858, sec. 4.1: 1.2). Plain greedy decoding of a 5M-parameter model falls into
#: loops ("self._check_closed()" again and again) until the token budget runs out, and which
#: bodies loop turns on the last bits of the arithmetic: over 3 SFT seeds from one pretrained
#: model plain greedy gave 62%, 41% and 46% with the same held-out loss (3.74-3.76), the
#: penalty 87%, 78% and 83% (bench/RESULTS.md). The plain greedy figure is reported beside it.
SFT_EVAL_REPETITION_PENALTY = 1.2


def sft_speedrun(cfg: Config, out: Path, init: Path, runtime: Runtime, resume: bool = False,
                 progress: bool = True) -> dict:
    """SFT from the pretrained checkpoint `init` on the standard-library function set (the
    [sft] keys of `cfg`; sft.data is forced to "stdlib"), into OUT/sft. Then, on held-out
    modules: the SFT validation loss (nats per supervised token) and the fraction of greedy
    bodies (at most SFT_EVAL_MAX_NEW_TOKENS tokens, for SFT_EVAL_PROMPTS prompts whose
    reference body fits in that budget) that parse with ast.parse under their signature,
    decoded under `runtime` (the speedrun's decoding runtime). The bodies go to OUT/sft_samples.json."""
    log("== 5/5 sft")
    run_dir = out / "sft"
    scfg = replace(cfg, sft=replace(cfg.sft, init=str(init), data="stdlib"))
    last = sft_stage(scfg, run_dir, resume=resume, progress=progress)
    if last.get("interrupted"):  # the checkpoint is written; `speedrun --resume` continues
        raise Interrupted(last.get("signal", signal.SIGINT))
    rows = [json.loads(x) for x in (run_dir / METRICS_FILE).read_text().splitlines() if x.strip()]
    val_loss = last.get("val_loss")
    if val_loss is None:  # a resumed run that had already finished: its last validation
        val_loss = next((r["val_loss"] for r in reversed(rows) if r.get("val_loss") is not None), None)
    model, tok, _, ckpt_path = load_checkpoint(run_dir, device=runtime.device)
    items = held_out_prompts(run_dir / SFT_VAL_FILE, tok, SFT_EVAL_PROMPTS, SFT_EVAL_MAX_NEW_TOKENS - 1)
    policy = SamplingConfig(greedy=True, repetition_penalty=SFT_EVAL_REPETITION_PENALTY)
    parse = body_parse_rate(model, tok, items, SFT_EVAL_MAX_NEW_TOKENS, runtime=runtime, sampling=policy)
    plain = body_parse_rate(model, tok, items, SFT_EVAL_MAX_NEW_TOKENS, runtime=runtime)
    parse["doctests"] = doctest_pass_rate(items, parse["examples"])
    parse["repetition_penalty"] = SFT_EVAL_REPETITION_PENALTY
    parse["plain_greedy"] = {k: v for k, v in plain.items() if k != "examples"}
    write_json(out / "sft_samples.json", parse)
    data = json.loads((run_dir / SFT_DATA_FILE).read_text(encoding="utf-8"))
    shown = f"{val_loss:.4f}" if val_loss is not None else "-"
    log(f"sft: validation loss {shown} nats/token; {parse['parsed']}/{parse['n']} generated bodies end their "
        f"turn and parse ({parse['stopped']} ended their turn; greedy, repetition penalty "
        f"{SFT_EVAL_REPETITION_PENALTY}); plain greedy: {plain['parsed']}/{plain['n']}")
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
        "sft_repetition_penalty": SFT_EVAL_REPETITION_PENALTY,
        "sft_greedy_parse_and_im_end_fraction": plain["parsed_and_im_end"] / max(1, plain["n"]),
        "sft_seed": cfg.train.seed,
        "sft_doctest_passed": parse["doctests"]["passed"],
        "sft_doctest_n": parse["doctests"]["n"],
        "sft_checkpoint": str(ckpt_path),
        "sft_health": (last.get("health") or {}).get("verdict", "-"),
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
        ("SFT bodies that parse and end with <|im_end|>",
         f"{s.get('sft_parse_and_im_end_fraction', float('nan')):.0%} of {s['sft_parse_n']} held-out prompts "
         f"(greedy, repetition penalty {s.get('sft_repetition_penalty', 1.0)}, within {SFT_EVAL_MAX_NEW_TOKENS} "
         f"tokens; {s.get('sft_im_end', '-')} ended with <|im_end|>; plain greedy "
         f"{s.get('sft_greedy_parse_and_im_end_fraction', float('nan')):.0%}); one run, SFT seed "
         f"{s.get('sft_seed', '-')} (over 3 seeds: bench/quality.py --sft-seeds)"),
        ("SFT docstring examples (>>>) passed", f"{s.get('sft_doctest_passed', '-')} of {s.get('sft_doctest_n', '-')} "
                                                f"functions whose reference passes them"),
    ]
