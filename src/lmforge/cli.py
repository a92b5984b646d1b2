"""The `lmforge` command line: a table from each command to the stage it calls (`COMMANDS`; the
arguments of each in `lmforge.cli_args`), and `main`, which runs one and says how it ended
(signals and the exit of a multi-rank process: `lmforge.signals`).

Every subcommand takes `--config FILE` (a TOML recipe; default: the built-in defaults,
which equal configs/stdlib-tiny.toml) and repeatable `--set section.key=value`.

Exit codes: 0 the command finished; 2 refused input (one `error:` line, no traceback,
nothing changed on disk); 130 stopped by SIGINT (Ctrl-C) and 143 by SIGTERM (a training
command first writes a checkpoint and prints how to resume).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from lmforge import signals
from lmforge.cli_args import (chat_args, check_path_args, common_args, eval_args, export_args, generate_args,
                              import_gguf_args, import_hf_args, import_tokenizer_args, prepare_args, progress_args, serve_args,
                              speedrun_args, training_args)
from lmforge.errors import Interrupted, LmforgeError, os_error

EPILOG = """\
stages, in order:
  lmforge train-tokenizer --out runs/tok          byte-level BPE on data.source
  (or: lmforge import-tokenizer --from hf_tokenizer_dir --out runs/tok   bring your own)
  lmforge prepare --set tokenizer.dir=runs/tok --out runs/data
  lmforge pretrain --set tokenizer.dir=runs/tok --set data.dir=runs/data --out runs/pre
  lmforge generate --checkpoint runs/pre --prompt "def "
  lmforge sft --set sft.init=runs/pre --out runs/sft   fine-tune on conversations (sft.data)
  lmforge dpo --set dpo.init=runs/sft --out runs/dpo   preference tuning on pairs (dpo.data)
  lmforge rl --set rl.init=runs/sft --out runs/rl      RL with verifiable rewards (rl.rewards)
  lmforge chat --checkpoint runs/sft                  talk to it; /exit quits
  lmforge eval --checkpoint runs/pre
  lmforge serve --checkpoint runs/sft                 OpenAI API + chat page on http://127.0.0.1:8000/
  lmforge speedrun --out runs/speedrun             all of the above on the standard library
"""


def _config(args):
    from lmforge.config import load_config
    from lmforge.fileio import check_path_text

    cfg = load_config(args.config, args.overrides)
    for name in CONFIG_PATHS:  # a NUL or an unencodable character: refused before any file is opened
        section, key = name.split(".")
        check_path_text(getattr(getattr(cfg, section), key), name)
    for i, entry in enumerate(cfg.data.sources):
        check_path_text(entry["source"], f"data.sources[{i}].source")
    return cfg


#: Config keys that hold paths (the command-line arguments that do: `cli_args.PATH_ARGS`).
CONFIG_PATHS = ("tokenizer.dir", "data.source", "data.dir", "train.init", "sft.init", "sft.data", "dpo.init",
                "dpo.data", "rl.init", "rl.data")


def _settings_inputs(args) -> list[tuple[str, str | None]]:
    """The files this command reads its settings from, as `fileio.check_not_input`'s (name, path)
    pairs: --config and the overlay (`LMFORGE_CONFIG_OVERLAY`)."""
    import os

    from lmforge.config import OVERLAY_ENV

    return [("--config", args.config), (OVERLAY_ENV, os.environ.get(OVERLAY_ENV) or None)]


def _not_settings(out, args, own_check=None) -> None:
    """No output is, or holds, the command's --config file or the overlay file, --force or not
    (`fileio.check_not_input`; `own_check`: the writer's own check, whose words come first). A
    training run's folder may hold its own config.toml given as --config (`--resume` of a run
    with its recorded config), so the training commands do not call this: a run folder is never
    one file, and what it replaces is its own checkpoints."""
    from lmforge.fileio import check_not_input

    if out is not None and str(out):
        check_not_input(out, _settings_inputs(args), own_check=own_check)


def _sampling_config(args):
    return _config(args).generate.override(
        greedy=args.greedy or None, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, repetition_penalty=getattr(args, "repetition_penalty", None))


def _need_out(args, what: str) -> Path:
    if not args.out:
        raise LmforgeError(f"{args.command} needs --out {what}.")
    return Path(args.out)


def _exit_for(last: dict) -> int:
    """0 for a finished training run; 128 + the signal for one a signal stopped."""
    return 128 + int(last.get("signal", signal.SIGTERM)) if last.get("interrupted") else 0


# -- the commands: each parses nothing, calls one stage ----------------------------------------
def _train_tokenizer(args) -> int:
    from lmforge.stages import train_tokenizer_stage
    from lmforge.fileio import check_output
    from lmforge.tokenizer.train import TOKENIZER_OUTPUT

    cfg = _config(args)
    out = Path(args.out or cfg.tokenizer.dir)
    _not_settings(out, args, own_check=lambda: check_output(out, TOKENIZER_OUTPUT, "the tokenizer stage",
                                                            replace_whole=True))
    train_tokenizer_stage(cfg, args.out, progress=not args.no_progress)
    return 0


def _import_tokenizer(args) -> int:
    from lmforge.stages import import_tokenizer_stage
    from lmforge.fileio import check_output
    from lmforge.tokenizer.train import TOKENIZER_OUTPUT

    cfg = _config(args)
    out = Path(args.out or cfg.tokenizer.dir)
    _not_settings(out, args, own_check=lambda: check_output(out, TOKENIZER_OUTPUT, "import-tokenizer",
                                                            replace_whole=True))
    import_tokenizer_stage(cfg, args.src, args.out)
    return 0


def _prepare(args) -> int:
    from lmforge.stages import prepare_stage
    from lmforge.data.prepare import PREPARE_OUTPUT
    from lmforge.fileio import check_output

    cfg = _config(args)
    out = Path(args.out or cfg.data.dir)
    _not_settings(out, args, own_check=lambda: check_output(out, PREPARE_OUTPUT, "`lmforge prepare`",
                                                            replace_whole=True))
    if args.executor == "slurm":
        from lmforge.data.cluster import submit_slurm
        from lmforge.tokenizer import Tokenizer

        sub = submit_slurm(cfg, out, Tokenizer.load(cfg.tokenizer.dir))
        print(f"prepare: {sub['tasks']} tasks submitted to Slurm: " + ", ".join(
            f"{stage} job {job}" for stage, job in sub["jobs"].items()) + f"; {out} is written when the finish job "
            f"ends (scripts and logs in {sub['work']}/logs; the same command again submits what is not done)",
            file=sys.stderr)
        return 0
    prepare_stage(cfg, args.out, progress=not args.no_progress, executor=args.executor)
    return 0


def _train(stage_name: str, budgeted: bool = False) -> Callable[[argparse.Namespace], int]:
    """The runner of a training command. `budgeted`: its stage takes train.time_budget_s, counted from
    `started`: the process's start for the process's own command line, else the stage's own start."""
    def run(args) -> int:
        from lmforge import stages

        cfg = _config(args)
        out = Path(args.out) if args.out else (Path(".") if args.dry_run else _need_out(args, "DIR (the run folder)"))
        timing = {}
        if budgeted and getattr(args, "process_command", False):  # not for a call from Python: its own start
            from lmforge.train.budget import command_start

            timing["started"] = command_start()
        last = getattr(stages, stage_name)(cfg, out, resume=args.resume, dry_run=args.dry_run,
                                           progress=not args.no_progress, **timing)
        print(json.dumps(last))
        return _exit_for(last)

    return run


def _generate(args) -> int:
    from lmforge.stages import generate_stage

    print(generate_stage(_config(args), args.checkpoint, args.prompt, _sampling_config(args), args.tokenizer,
                         seed=args.seed, truncate=args.truncate))
    return 0


def _chat(args) -> int:
    from lmforge.stages import chat_stage

    chat_stage(args.checkpoint, _sampling_config(args), args.tokenizer, system=args.system, seed=args.seed)
    return 0


def _eval(args) -> int:
    from lmforge.stages import eval_stage
    from lmforge.fileio import check_user_file

    _not_settings(args.out, args, own_check=lambda: check_user_file(args.out, args.force, _settings_inputs(args)))
    if args.tasks is not None:
        return _eval_tasks(args)
    res = eval_stage(args.checkpoint, args.data, args.split, args.out, force=args.force)
    print(f"loss {res['loss']:.4f} nats/token, perplexity {res['perplexity']:.2f}, "
          f"{res['bits_per_byte']:.4f} bits/byte over {res['tokens']:,} tokens ({res['bytes']:,} bytes)")
    print(json.dumps(res))
    return 0


def _eval_tasks(args) -> int:
    import time

    from lmforge.errors import ConfigError
    from lmforge.evals.suite import results_table
    from lmforge.stages.eval import eval_tasks_stage

    t0 = time.perf_counter()

    def progress(name, r):
        print(f"eval: {name}: {r['accuracy']:.1%} of {r['n']} (baseline {r['baseline']:.1%}, centred "
              f"{r['centred']:+.3f}) at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    try:
        ks = tuple(int(k) for k in args.k.split(",") if k.strip())
    except ValueError:  # refused input, named by its option
        raise ConfigError(f"--k {args.k!r}: expected comma-separated integers, e.g. 1,5,10.") from None
    res = eval_tasks_stage(args.checkpoint, args.tasks, args.limit, args.seed, args.out, args.force, progress,
                           args.samples, args.temperature, ks)
    print(results_table(res))
    print(f"{len(res['tasks'])} task(s) in {time.perf_counter() - t0:.1f} s; suite (mean centred score) "
          f"{res['suite']:+.3f}" + (f"; written to {args.out}" if args.out else ""))
    return 0


def _export(args) -> int:
    from lmforge.stages import export_stage
    from lmforge.stages.export import export_output_check

    what = "FILE.gguf (the file to write)" if args.format == "gguf" else "DIR (the Hugging Face folder to write)"
    out = _need_out(args, what)
    _not_settings(out, args, own_check=export_output_check(args.format, out, args.force, _settings_inputs(args)))
    print(export_stage(args.checkpoint, out, fmt=args.format, dtype=args.dtype,
                       verify=args.verify, force=args.force, evaluation=args.evaluation))
    return 0


def _import_hf(args) -> int:
    from lmforge.stages import import_hf_stage
    from lmforge.stages.export import import_output_check

    out = _need_out(args, "DIR (the lmforge checkpoint folder to write)")
    cfg = _config(args)
    _not_settings(out, args, own_check=import_output_check(out))
    print(import_hf_stage(args.folder, out, eos_token=cfg.tokenizer.eos_token))
    return 0


def _import_gguf(args) -> int:
    from lmforge.stages import import_gguf_stage
    from lmforge.stages.export import import_output_check

    out = _need_out(args, "DIR (the lmforge checkpoint folder to write)")
    cfg = _config(args)
    _not_settings(out, args, own_check=import_output_check(out, "`lmforge import-gguf`"))
    print(import_gguf_stage(args.file, out, eos_token=cfg.tokenizer.eos_token))
    return 0


def _serve(args) -> int:
    from lmforge.stages.serve import serve_stage

    def names(value: str | None) -> list[str] | None:
        return None if value is None else [v.strip() for v in value.split(",")]

    serve_stage(args.checkpoint, args.host, args.port, args.tokenizer, max_batch=args.max_batch,
                max_queue=args.max_queue, max_tokens=args.max_tokens, timeout_s=args.timeout,
                allowed_hosts=names(args.allowed_hosts), cors_origins=names(args.cors_origin),
                max_body_bytes=args.max_body_bytes, io_timeout_s=args.io_timeout)
    return 0


def _speedrun(args) -> int:
    from lmforge.stages import speedrun_stage

    speedrun_stage(_config(args), args.out or "runs/speedrun", resume=args.resume, progress=not args.no_progress)
    return 0


#: command -> (help, --out help or None, argument adder, runner)
COMMANDS: dict[str, tuple[str, str | None, Callable, Callable]] = {
    "train-tokenizer": ("train the byte-level BPE tokenizer on data.source",
                        "where to write the tokenizer (default: tokenizer.dir)", progress_args, _train_tokenizer),
    "import-tokenizer": ("bring your own Hugging Face tokenizer folder (derives the contract)",
                         "where to write the lmforge tokenizer folder (default: tokenizer.dir)",
                         import_tokenizer_args, _import_tokenizer),
    "prepare": ("pretokenize data.source into .bin/.idx shards (exact duplicates dropped; data.filters and "
                "data.dedup = \"minhash\" remove more, through datatrove)",
                "where to write the shards (default: data.dir)", prepare_args, _prepare),
    "pretrain": ("pretrain a model on the prepared shards",
                 "run folder (metrics.jsonl, config.toml, step_NNNNNN/ checkpoints)", training_args,
                 _train("pretrain_stage", budgeted=True)),
    "sft": ("supervised fine-tuning on conversations, from sft.init",
            "run folder (metrics.jsonl, config.toml, step_NNNNNN/ checkpoints)", training_args, _train("sft_stage")),
    "dpo": ("direct preference optimisation on chosen/rejected pairs (dpo.data), from dpo.init; full or LoRA "
            "([lora] rank > 0); the reference is dpo.init itself",
            "run folder (metrics.jsonl with rewards/* and logps/*, config.toml, step_NNNNNN/ checkpoints)",
            training_args, _train("dpo_stage")),
    "rl": ("reinforcement learning with verifiable rewards (rl.rewards) on prompts (rl.data), from rl.init; "
           "G completions per prompt, group-relative advantages; full or LoRA; generated code runs in a sandbox",
           "run folder (metrics.jsonl with reward, rewards/*, completions/*, config.toml, step_NNNNNN/ checkpoints)",
           training_args, _train("rl_stage")),
    "generate": ("sample a continuation from a checkpoint", None, generate_args, _generate),
    "chat": ("chat with a fine-tuned checkpoint (one line a turn; /exit or EOF quits)", None, chat_args, _chat),
    "eval": ("held-out loss, perplexity and bits per byte of a checkpoint; --tasks: an evaluation suite",
             "write the results as JSON to this file", eval_args, _eval),
    "export": ("write a checkpoint as a Hugging Face folder of its family, a GGUF file, or PEFT adapters",
               "the Hugging Face folder (--format hf) or .gguf file (--format gguf) to write (required)",
               export_args, _export),
    "import-hf": ("turn a Hugging Face folder (Llama, Mistral, Qwen2/3, Gemma 3/2, OLMo 2) into an lmforge checkpoint",
                  "the lmforge checkpoint folder to write (required)", import_hf_args, _import_hf),
    "import-gguf": ("turn a GGUF file (llama, qwen2, qwen3, gemma3, gemma2, olmo2; any quantization) into an lmforge checkpoint",
                    "the lmforge checkpoint folder to write (required)", import_gguf_args, _import_gguf),
    "serve": ("an OpenAI-compatible server (batched decoding) with a chat page at /", None, serve_args, _serve),
    "speedrun": ("every stage on the embedded corpus, then a summary table",
                 "output folder (default: runs/speedrun)", speedrun_args, _speedrun),
}

#: Commands that can continue after an interruption (the Ctrl-C message says so only for them).
RESUMABLE = ("pretrain", "sft", "dpo", "rl", "speedrun")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmforge",
        description="Train small language models end to end: tokenizer, data, pretraining, SFT, DPO, RL (each "
                    "full or LoRA), generation, evaluation, serving, export (Hugging Face, GGUF, PEFT) and import.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, out_help, add_args, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        common_args(p, out_help)
        add_args(p)
    return parser


def _version() -> str:
    from lmforge import __version__

    return f"lmforge {__version__}"


def run(args: argparse.Namespace) -> int:
    return COMMANDS[args.command][3](args)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit code (0, 2 refused input, 130/143 stopped by a signal:
    `lmforge.signals`).

    Any refusal of the operating system (an OSError) that a writer or reader did not explain
    itself is reported here, naming the path; SIGXFSZ is ignored, so a write past `ulimit -f`
    fails with EFBIG and is reported like a full disk instead of killing the process.
    """
    for stream in (sys.stdout, sys.stderr):  # a path with non-UTF-8 bytes in a message: \xNN, never a crash
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    previous = signals.command_handlers()  # SIGINT/SIGTERM unwind the command from here on
    command, code = None, 2
    try:
        try:
            args = build_parser().parse_args(argv)
            args.process_command = argv is None  # the command line of this process (not a call from Python)
            command = args.command
            check_path_args(args)
            code = run(args)
        except LmforgeError as exc:  # refused input: one line, no traceback
            code = 2
            signals.end_progress_lines()
            print(f"error: {exc}", file=sys.stderr)
        except OSError as exc:  # the last resort: a refusal no reader or writer explained
            code = 2
            signals.end_progress_lines()
            print(f"error: {os_error(exc, doing='access')}", file=sys.stderr)
        except (Interrupted, KeyboardInterrupt, Exception) as exc:
            signum = signals.stop_signal(exc)  # an error with no signal behind it is a bug: raised
            code = 128 + signum  # set first: a second signal may cut the report short
            signals.report_stop(signum, not isinstance(exc, KeyboardInterrupt), command in RESUMABLE, previous)
    except (Interrupted, KeyboardInterrupt) as exc:  # a second signal while the first or an error was reported
        code = code if code >= 128 else 128 + int(getattr(exc, "signum", signal.SIGINT))
    finally:
        signals.restore_handlers(previous, interrupted=code >= 128, own_process=argv is None)
    if argv is None:  # the process's own command: a multi-rank one ends past gloo's teardown
        signals.exit_past_gloo_teardown(code, _distributed_used)
    return code


def _distributed_used() -> bool:
    from lmforge.train import distributed

    return distributed.initialised_this_process()


if __name__ == "__main__":
    raise SystemExit(main())
