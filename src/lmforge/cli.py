"""The `lmforge` command line: argument parsing only; each subcommand calls a stage.

Every subcommand takes `--config FILE` (a TOML recipe; default: the built-in defaults,
which equal configs/stdlib-tiny.toml) and repeatable `--set section.key=value`.

Exit codes: 0 the command finished; 2 refused input (one `error:` line, no traceback,
nothing changed on disk); 130 stopped by SIGINT (Ctrl-C) and 143 by SIGTERM (a training
command first writes a checkpoint and prints how to resume).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from lmforge.errors import (Interrupted, LmforgeError, clear_stop_requests, first_stop_signal, os_error,
                            request_stop, stop_requested)

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


def _common(p: argparse.ArgumentParser, out_help: str | None = None) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML recipe (default: built-in stdlib-tiny defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value; repeatable, e.g. --set train.steps=100")
    if out_help:
        p.add_argument("--out", metavar="DIR", type=_path_arg, help=out_help)


def _progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _training(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    p.add_argument("--dry-run", action="store_true",
                   help="run every check and one forward/backward pass, write nothing, exit")
    _progress(p)


def _checkpoint(p: argparse.ArgumentParser, tokenizer: bool = True) -> None:
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a run folder or a step_NNNNNN folder")
    if tokenizer:
        p.add_argument("--tokenizer", metavar="DIR",
                       help="tokenizer folder (default: the checkpoint's own); must match")


def _sampling(p: argparse.ArgumentParser, repetition_penalty: bool = True) -> None:
    """The [generate] overrides shared by generate and chat (lmforge.config.SamplingConfig)."""
    p.add_argument("--max-new-tokens", type=int, help="default: generate.max_new_tokens")
    p.add_argument("--temperature", type=float, help="default: generate.temperature")
    p.add_argument("--top-k", type=int, help="default: generate.top_k (0 = off)")
    p.add_argument("--top-p", type=float, help="default: generate.top_p (1 = off)")
    if repetition_penalty:
        p.add_argument("--repetition-penalty", type=float, help="default: generate.repetition_penalty (1 = off)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding")
    p.add_argument("--seed", type=_seed, default=None, help="seed for sampling, 0 <= seed < 2**63 (default: unseeded)")


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{value} is out of range: expected 0 <= seed < 2**63")
    return value


def _path_arg(text: str) -> str:
    """A path on the command line: not empty (an empty --out would silently mean the config's folder).
    Bytes that are not UTF-8 are a real Linux file name (Python keeps them as surrogate escapes);
    what no file system can take is refused by `_check_path_args`."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path; give a path")
    return text


def _text_arg(text: str) -> str:
    """A command-line text: it must be UTF-8 (argv bytes that are not arrive as surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("not UTF-8 text; pass the text in UTF-8") from None
    return text


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


#: Config keys that hold paths, and the command-line arguments that do (dest -> how it is spelt).
CONFIG_PATHS = ("tokenizer.dir", "data.source", "data.dir", "train.init", "sft.init", "sft.data", "dpo.init",
                "dpo.data", "rl.init", "rl.data")
PATH_ARGS = {"config": "--config", "out": "--out", "checkpoint": "--checkpoint", "tokenizer": "--tokenizer",
             "src": "--from", "data": "--data", "folder": "DIR"}


def _check_path_args(args) -> None:
    from lmforge.fileio import check_path_text

    for dest, spelt in PATH_ARGS.items():
        check_path_text(getattr(args, dest, None), spelt)


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

    train_tokenizer_stage(_config(args), args.out, progress=not args.no_progress)
    return 0


def _import_tokenizer(args) -> int:
    from lmforge.stages import import_tokenizer_stage

    import_tokenizer_stage(_config(args), args.src, args.out)
    return 0


def _prepare(args) -> int:
    from lmforge.stages import prepare_stage

    prepare_stage(_config(args), args.out, progress=not args.no_progress)
    return 0


def _train(stage_name: str) -> Callable[[argparse.Namespace], int]:
    def run(args) -> int:
        from lmforge import stages

        cfg = _config(args)
        out = Path(args.out) if args.out else (Path(".") if args.dry_run else _need_out(args, "DIR (the run folder)"))
        if getattr(args, "process_command", False):  # train.time_budget_s counts from the process's start
            from lmforge.stages import common

            common.COMMAND_AGE = common.process_age_s()
        last = getattr(stages, stage_name)(cfg, out, resume=args.resume, dry_run=args.dry_run,
                                           progress=not args.no_progress)
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
    except ValueError:
        raise ConfigError(f"--k {args.k!r}: expected comma-separated integers, e.g. 1,5,10.") from None
    res = eval_tasks_stage(args.checkpoint, args.tasks, args.limit, args.seed, args.out, args.force, progress,
                           args.samples, args.temperature, ks)
    print(results_table(res))
    print(f"{len(res['tasks'])} task(s) in {time.perf_counter() - t0:.1f} s; suite (mean centred score) "
          f"{res['suite']:+.3f}" + (f"; written to {args.out}" if args.out else ""))
    return 0


def _export(args) -> int:
    from lmforge.stages import export_stage

    what = "FILE.gguf (the file to write)" if args.format == "gguf" else "DIR (the Hugging Face folder to write)"
    print(export_stage(args.checkpoint, _need_out(args, what), fmt=args.format, dtype=args.dtype,
                       verify=args.verify, force=args.force, evaluation=args.evaluation))
    return 0


def _import_hf(args) -> int:
    from lmforge.stages import import_hf_stage

    print(import_hf_stage(args.folder, _need_out(args, "DIR (the lmforge checkpoint folder to write)"),
                          eos_token=_config(args).tokenizer.eos_token))
    return 0


def _import_gguf(args) -> int:
    from lmforge.stages import import_gguf_stage

    print(import_gguf_stage(args.file, _need_out(args, "DIR (the lmforge checkpoint folder to write)"),
                            eos_token=_config(args).tokenizer.eos_token))
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


def _args_serve(p):
    _checkpoint(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument("--max-batch", type=int, default=16, help="requests decoded together at most (default 16)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting at most; beyond: 429 (default 64)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="per-request limit on max_tokens (default: the model's context - 1)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request time limit in seconds (default 120)")
    p.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="comma-separated Host header names served besides the defaults (loopback: localhost, "
                        "127.0.0.1, [::1]); required with --host 0.0.0.0; '*' accepts any Host")
    p.add_argument("--cors-origin", default=None, metavar="ORIGINS",
                   help="comma-separated origins (e.g. http://localhost:3000) allowed to call the API from a web "
                        "page (default: none, no CORS headers)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request body in bytes; beyond: 413 (default 4 MiB)")
    p.add_argument("--io-timeout", type=float, default=30.0,
                   help="seconds a client may take to send its request, or to read a response write; then it "
                        "is cut (default 30)")


def _speedrun(args) -> int:
    from lmforge.stages import speedrun_stage

    speedrun_stage(_config(args), args.out or "runs/speedrun", resume=args.resume, progress=not args.no_progress)
    return 0


def _args_import_tokenizer(p):
    p.add_argument("--from", dest="src", required=True, metavar="DIR",
                   help="a folder with tokenizer.json + tokenizer_config.json, as transformers saves it")


def _args_generate(p):
    _checkpoint(p)
    p.add_argument("--prompt", default="", type=_text_arg, help="text to continue (a document start)")
    _sampling(p)
    p.add_argument("--truncate", action="store_true", help="keep the prompt's last tokens if it is too long")


def _args_chat(p):
    _checkpoint(p)
    p.add_argument("--system", default=None, type=_text_arg, help="a system message that opens the conversation")
    _sampling(p, repetition_penalty=False)


def _args_eval(p):
    _checkpoint(p, tokenizer=False)
    p.add_argument("--data", metavar="DIR", help="prepared data folder (default: the checkpoint's data.dir)")
    p.add_argument("--split", default="val", choices=("train", "val"))
    p.add_argument("--tasks", metavar="NAMES",
                   help="instead of the loss, an evaluation suite: comma-separated built-in tasks (mutants, "
                        "docstrings, next_line, identifier; 'builtin' for all: Python from modules the model "
                        "never read; functions: bodies run in the sandbox, pass@k) and/or .jsonl/.parquet files of {query, choices, gold} or {context, "
                        "continuation} items; prints accuracy, random baseline, centred score and 95%% interval")
    p.add_argument("--limit", type=int, default=300, help="--tasks: at most this many items a task (0 = all)")
    p.add_argument("--seed", type=int, default=0, help="--tasks: draws the distractors, gold positions and samples")
    p.add_argument("--samples", type=int, default=0,
                   help="--tasks functions: bodies sampled per function for pass@k (0: greedy pass@1 only)")
    p.add_argument("--temperature", type=float, default=0.8, help="--tasks functions: sampling temperature")
    p.add_argument("--k", default="1", help="--tasks functions: the k of pass@k, comma-separated (each <= --samples)")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")


def _args_export(p):
    _checkpoint(p, tokenizer=False)
    # the values are checked in one place, lmforge.export.check_export_options
    p.add_argument("--format", default="hf", metavar="{hf,gguf,peft}",
                   help="hf: a transformers folder (default); gguf: one file for llama.cpp / Ollama; "
                        "peft: a LoRA run's adapters as a PEFT adapter folder")
    p.add_argument("--dtype", default="float32", metavar="{float32,bfloat16,float16,q8_0}",
                   help="weight type (q8_0: --format gguf only)")
    p.add_argument("--verify", action="store_true", help="compare logits with transformers (needs lmforge[hf])")
    p.add_argument("--evaluation", metavar="FILE",
                   help="--format hf: the results JSON of `lmforge eval --tasks ... --out FILE` for this checkpoint, "
                        "put in the model card (README.md)")
    p.add_argument("--force", action="store_true", help="--format gguf: replace an existing --out file")


def _args_import_hf(p):
    p.add_argument("folder", metavar="DIR", help="a folder written by transformers' save_pretrained")


def _args_import_gguf(p):
    p.add_argument("file", metavar="FILE", help="a .gguf file (architecture llama, qwen2, qwen3, gemma3, gemma2 or olmo2)")


def _args_speedrun(p):
    p.add_argument("--resume", action="store_true", help="keep finished stages, continue pretraining")
    _progress(p)


#: command -> (help, --out help or None, argument adder, runner)
COMMANDS: dict[str, tuple[str, str | None, Callable, Callable]] = {
    "train-tokenizer": ("train the byte-level BPE tokenizer on data.source",
                        "where to write the tokenizer (default: tokenizer.dir)", _progress, _train_tokenizer),
    "import-tokenizer": ("bring your own Hugging Face tokenizer folder (derives the contract)",
                         "where to write the lmforge tokenizer folder (default: tokenizer.dir)",
                         _args_import_tokenizer, _import_tokenizer),
    "prepare": ("pretokenize data.source into .bin/.idx shards",
                "where to write the shards (default: data.dir)", _progress, _prepare),
    "pretrain": ("pretrain a model on the prepared shards",
                 "run folder (metrics.jsonl, config.toml, step_NNNNNN/ checkpoints)", _training,
                 _train("pretrain_stage")),
    "sft": ("supervised fine-tuning on conversations, from sft.init",
            "run folder (metrics.jsonl, config.toml, step_NNNNNN/ checkpoints)", _training, _train("sft_stage")),
    "dpo": ("direct preference optimisation on chosen/rejected pairs (dpo.data), from dpo.init; full or LoRA "
            "([lora] rank > 0); the reference is dpo.init itself",
            "run folder (metrics.jsonl with rewards/* and logps/*, config.toml, step_NNNNNN/ checkpoints)",
            _training, _train("dpo_stage")),
    "rl": ("reinforcement learning with verifiable rewards (rl.rewards) on prompts (rl.data), from rl.init; "
           "G completions per prompt, group-relative advantages; full or LoRA; generated code runs in a sandbox",
           "run folder (metrics.jsonl with reward, rewards/*, completions/*, config.toml, step_NNNNNN/ checkpoints)",
           _training, _train("rl_stage")),
    "generate": ("sample a continuation from a checkpoint", None, _args_generate, _generate),
    "chat": ("chat with a fine-tuned checkpoint (one line a turn; /exit or EOF quits)", None, _args_chat, _chat),
    "eval": ("held-out loss, perplexity and bits per byte of a checkpoint; --tasks: an evaluation suite",
             "write the results as JSON to this file", _args_eval, _eval),
    "export": ("write a checkpoint as a Hugging Face folder of its family, a GGUF file, or PEFT adapters",
               "the Hugging Face folder (--format hf) or .gguf file (--format gguf) to write (required)",
               _args_export, _export),
    "import-hf": ("turn a Hugging Face folder (Llama, Mistral, Qwen2/3, Gemma 3/2, OLMo 2) into an lmforge checkpoint",
                  "the lmforge checkpoint folder to write (required)", _args_import_hf, _import_hf),
    "import-gguf": ("turn a GGUF file (llama, qwen2, qwen3, gemma3, gemma2, olmo2; any quantization) into an lmforge checkpoint",
                    "the lmforge checkpoint folder to write (required)", _args_import_gguf, _import_gguf),
    "serve": ("an OpenAI-compatible server (batched decoding) with a chat page at /", None, _args_serve, _serve),
    "speedrun": ("every stage on the embedded corpus, then a summary table",
                 "output folder (default: runs/speedrun)", _args_speedrun, _speedrun),
}

#: Commands that can continue after an interruption (the Ctrl-C message says so only for them).
RESUMABLE = ("pretrain", "sft", "dpo", "rl", "speedrun")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmforge",
        description="Train small language models end to end: tokenizer, data, pretraining, SFT, "
                    "generation, evaluation, export.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, out_help, add_args, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        _common(p, out_help)
        add_args(p)
    return parser


def _version() -> str:
    from lmforge import __version__

    return f"lmforge {__version__}"


def run(args: argparse.Namespace) -> int:
    return COMMANDS[args.command][3](args)


def _on_signal(signum, frame):
    """SIGINT / SIGTERM outside a training loop (which handles them itself, finishing the step):
    unwind, so every writer removes its temporary and its lock; exit 130 / 143. Recorded too,
    for native code that swallows the exception (`errors.raise_if_stopped`). A second signal
    while the first one's shutdown runs is only recorded: the clean-up finishes, the exit
    code is the first signal's, and no traceback is printed."""
    if stop_requested():
        request_stop(signum)
        return
    request_stop(signum)
    raise Interrupted(signum)


def _quiet(signum, frame):
    """The handler while a command's end is reported: a signal is recorded, nothing raised."""
    request_stop(signum)


def _interrupted(exc: BaseException, command: str | None) -> int:
    """Report a stop by SIGINT/SIGTERM (Interrupted, or KeyboardInterrupt from a second Ctrl-C in
    a training loop); the exit code: 128 + the signal."""
    signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
    if command in RESUMABLE:
        hint = "checkpoints are kept; run the same command with --resume to continue"
        hint += " (`make speedrun` resumes by itself)" if isinstance(exc, Interrupted) else ""
    else:
        hint = "nothing was written (outputs are replaced only when complete); run the command again"
    name = f" ({signal.Signals(signum).name})" if isinstance(exc, Interrupted) else ""
    print(f"interrupted{name}: {hint}", file=sys.stderr)
    return 128 + int(signum)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit code (0, 2 refused input, 130/143 stopped by a signal).

    Any refusal of the operating system (an OSError) that a writer or reader did not explain
    itself is reported here, naming the path; SIGXFSZ is ignored, so a write past `ulimit -f`
    fails with EFBIG and is reported like a full disk instead of killing the process.
    """
    import threading

    clear_stop_requests()
    for stream in (sys.stdout, sys.stderr):  # a path with non-UTF-8 bytes in a message: \xNN, never a crash
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    previous: dict = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        previous[signal.SIGXFSZ] = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    command, code = None, 2
    try:
        try:
            args = build_parser().parse_args(argv)
            args.process_command = argv is None  # the command line of this process (not a call from Python)
            command = args.command
            _check_path_args(args)
            code = run(args)
        except LmforgeError as exc:
            code = 2
            _end_progress_lines()
            print(f"error: {exc}", file=sys.stderr)
        except OSError as exc:  # the last resort: a refusal no reader or writer explained
            code = 2
            _end_progress_lines()
            print(f"error: {os_error(exc, doing='access')}", file=sys.stderr)
        except (Interrupted, KeyboardInterrupt, Exception) as exc:
            if not isinstance(exc, (Interrupted, KeyboardInterrupt)):
                if not stop_requested():
                    raise  # a bug: its traceback is wanted
                # the shutdown after a signal failed on the way (a second Ctrl-C cut an import, a clean-up):
                # that is the signal's doing, reported as the stop it is
                exc = Interrupted(first_stop_signal() or signal.SIGINT)
            code = 128 + int(getattr(exc, "signum", signal.SIGINT))
            if previous:
                for s in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(s, _quiet)
            code = _interrupted(exc, command)
    except (Interrupted, KeyboardInterrupt) as exc:  # a second signal while the first or an error was reported
        code = code if code >= 128 else 128 + int(getattr(exc, "signum", signal.SIGINT))
    finally:
        interrupted = code >= 128
        for s, handler in previous.items():
            # the program itself (no argv) exits next: a further Ctrl-C must not print a traceback there
            signal.signal(s, signal.SIG_IGN if interrupted and argv is None and s != signal.SIGXFSZ else handler)
        if interrupted:
            _keyboard_interrupt_handled()
    if argv is None:
        _exit_past_gloo_teardown(code)
    return code


def _exit_past_gloo_teardown(code: int) -> None:
    """A process of a multi-rank run (torchrun: WORLD_SIZE > 1) that initialised torch.distributed
    ends here with os._exit, its output flushed, after every file of its run is closed (the stages
    write through lmforge.fileio) and its process group destroyed: at interpreter finalization gloo's
    C++ teardown aborted a finished rank now and then ("terminate called without an active
    exception", SIGABRT; torch 2.13, a 2-core CPU under load, 2026-11-27: torchrun then reported the
    run failed; pytorch/pytorch#179291 describes gloo's worker threads holding tensors past
    finalization). Single-process commands and calls from Python return as usual."""
    import torch.distributed as dist

    if os.environ.get("WORLD_SIZE", "1") in ("", "1") or not dist.is_available() or not _distributed_used():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _distributed_used() -> bool:
    from lmforge.train import distributed

    return distributed.initialised_this_process()


def _end_progress_lines() -> None:
    """A safety net for the `error:` line: a progress bar still open (the traceback of the error
    holds it; each stage closes its own) has left its line without a newline. End that line,
    so the error starts one of its own, and stop the bar: it draws nothing after the error.
    tqdm's bars only (its registry of open bars); a bar of the Rust tokenizers library draws
    only on a terminal and ends its line itself."""
    from tqdm import tqdm

    open_bars = [bar for bar in list(getattr(tqdm, "_instances", ())) if not getattr(bar, "disable", True)]
    for bar in open_bars:
        bar.disable = True  # its close(), when the traceback lets it go, then writes nothing
    if open_bars:
        sys.stderr.write("\n")


def _keyboard_interrupt_handled() -> None:
    """CPython marks a KeyboardInterrupt that crossed code run from C (a nested evaluation) as
    unhandled, and at exit kills the process with SIGINT: exit -2 instead of our 130, after
    the message was printed. It was handled here; clear the mark (CPython only, else nothing)."""
    import contextlib
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt").value = 0


if __name__ == "__main__":
    raise SystemExit(main())
