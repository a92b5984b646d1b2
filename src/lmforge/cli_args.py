"""The arguments of each `lmforge` command (argparse; `lmforge.cli` builds the parser from its
table of commands): the shared ones (`--config`, `--set`, `--out`, a training command's
`--resume`, `--dry-run` and `--no-progress`, a checkpoint, the sampling overrides), each command's
own, and the checks of a path or a text given on the command line."""

from __future__ import annotations

import argparse


def common_args(p: argparse.ArgumentParser, out_help: str | None = None) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML recipe (default: built-in stdlib-tiny defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value; repeatable, e.g. --set train.steps=100")
    if out_help:
        p.add_argument("--out", metavar="DIR", type=path_arg, help=out_help)


def progress_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def prepare_args(p: argparse.ArgumentParser) -> None:
    progress_args(p)
    p.add_argument("--executor", choices=("local", "slurm", "ray"), default="local",
                   help="local: data.workers tasks on this machine (default); slurm: the tasks as Slurm job "
                        "arrays (options in [data.executor]: partition, time, cpus_per_task, ...), the command "
                        "returning once they are queued: the last job writes the data folder; ray: the tasks on "
                        "a Ray cluster (data.executor.address, else one started here). The same shards for each")


def training_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    p.add_argument("--dry-run", action="store_true",
                   help="run every check and one forward/backward pass, write nothing, exit")
    progress_args(p)


def checkpoint_args(p: argparse.ArgumentParser, tokenizer: bool = True) -> None:
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a run folder or a step_NNNNNN folder")
    if tokenizer:
        p.add_argument("--tokenizer", metavar="DIR",
                       help="tokenizer folder (default: the checkpoint's own); must match")


def sampling_args(p: argparse.ArgumentParser, repetition_penalty: bool = True) -> None:
    """The [generate] overrides shared by generate and chat (lmforge.config.SamplingConfig)."""
    p.add_argument("--max-new-tokens", type=int, help="default: generate.max_new_tokens")
    p.add_argument("--temperature", type=float, help="default: generate.temperature")
    p.add_argument("--top-k", type=int, help="default: generate.top_k (0 = off)")
    p.add_argument("--top-p", type=float, help="default: generate.top_p (1 = off)")
    if repetition_penalty:
        p.add_argument("--repetition-penalty", type=float, help="default: generate.repetition_penalty (1 = off)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding")
    p.add_argument("--seed", type=seed_arg, default=None, help="seed for sampling, 0 <= seed < 2**63 (default: unseeded)")


def seed_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{value} is out of range: expected 0 <= seed < 2**63")
    return value


def path_arg(text: str) -> str:
    """A path on the command line: not empty (an empty --out would silently mean the config's folder).
    Bytes that are not UTF-8 are a real Linux file name (Python keeps them as surrogate escapes);
    what no file system can take is refused by `check_path_args`."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path; give a path")
    return text


def text_arg(text: str) -> str:
    """A command-line text: it must be UTF-8 (argv bytes that are not arrive as surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("not UTF-8 text; pass the text in UTF-8") from None
    return text


#: The command-line arguments that hold paths (dest -> how it is spelt), checked by `check_path_args`.
PATH_ARGS = {"config": "--config", "out": "--out", "checkpoint": "--checkpoint", "tokenizer": "--tokenizer",
             "src": "--from", "data": "--data", "folder": "DIR"}


def check_path_args(args) -> None:
    """Refuse a path argument no file system can take (a NUL, an unencodable character), naming it."""
    from lmforge.fileio import check_path_text

    for dest, spelt in PATH_ARGS.items():
        check_path_text(getattr(args, dest, None), spelt)


def serve_args(p):
    checkpoint_args(p)
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


def import_tokenizer_args(p):
    p.add_argument("--from", dest="src", required=True, metavar="DIR",
                   help="a folder with tokenizer.json + tokenizer_config.json, as transformers saves it")


def generate_args(p):
    checkpoint_args(p)
    p.add_argument("--prompt", default="", type=text_arg, help="text to continue (a document start)")
    sampling_args(p)
    p.add_argument("--truncate", action="store_true", help="keep the prompt's last tokens if it is too long")


def chat_args(p):
    checkpoint_args(p)
    p.add_argument("--system", default=None, type=text_arg, help="a system message that opens the conversation")
    sampling_args(p, repetition_penalty=False)


def eval_args(p):
    checkpoint_args(p, tokenizer=False)
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


def export_args(p):
    checkpoint_args(p, tokenizer=False)
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


def import_hf_args(p):
    p.add_argument("folder", metavar="DIR", help="a folder written by transformers' save_pretrained")


def import_gguf_args(p):
    p.add_argument("file", metavar="FILE", help="a .gguf file (architecture llama, qwen2, qwen3, gemma3, gemma2 or olmo2)")


def speedrun_args(p):
    p.add_argument("--resume", action="store_true", help="keep finished stages, continue pretraining")
    progress_args(p)
