"""The `lmforge` command line: argument parsing only; each subcommand calls a stage.

Every subcommand takes `--config FILE` (a TOML recipe; default: the built-in defaults,
which equal configs/stdlib-tiny.toml) and repeatable `--set section.key=value`.
Bad input prints one `error:` line (no traceback) and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lmforge.errors import LmforgeError

EPILOG = """\
stages, in order:
  lmforge train-tokenizer --out runs/tok          byte-level BPE on data.source
  (or: lmforge import-tokenizer --from hf_tokenizer_dir --out runs/tok   bring your own)
  lmforge prepare --set tokenizer.dir=runs/tok --out runs/data
  lmforge pretrain --set tokenizer.dir=runs/tok --set data.dir=runs/data --out runs/pre
  lmforge generate --checkpoint runs/pre --prompt "def "
  lmforge sft --set sft.init=runs/pre --out runs/sft   fine-tune on conversations (sft.data)
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
        p.add_argument("--out", metavar="DIR", help=out_help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmforge",
        description="Train small language models end to end: tokenizer, data, pretraining, SFT, "
                    "generation, evaluation, export.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("train-tokenizer", help="train the byte-level BPE tokenizer on data.source")
    _common(p, "where to write the tokenizer (default: tokenizer.dir)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("import-tokenizer", help="bring your own Hugging Face tokenizer folder (derives the contract)")
    _common(p, "where to write the lmforge tokenizer folder (default: tokenizer.dir)")
    p.add_argument("--from", dest="src", required=True, metavar="DIR",
                   help="a folder with tokenizer.json + tokenizer_config.json, as transformers saves it")

    p = sub.add_parser("prepare", help="pretokenize data.source into .bin/.idx shards")
    _common(p, "where to write the shards (default: data.dir)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    for name, what in (("pretrain", "pretrain a model on the prepared shards"),
                       ("sft", "supervised fine-tuning on conversations, from sft.init")):
        p = sub.add_parser(name, help=what)
        _common(p, "run folder (metrics.jsonl, config.toml, step_NNNNNN/ checkpoints)")
        p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
        p.add_argument("--dry-run", action="store_true",
                       help="run every check and one forward/backward pass, write nothing, exit")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("generate", help="sample a continuation from a checkpoint")
    _common(p)
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a run folder or a step_NNNNNN folder")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (default: the checkpoint's own); must match")
    p.add_argument("--prompt", default="", help="text to continue (a document start)")
    p.add_argument("--max-new-tokens", type=int, help="default: generate.max_new_tokens")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--greedy", action="store_true", help="argmax decoding")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--truncate", action="store_true", help="keep the prompt's last tokens if it is too long")

    p = sub.add_parser("chat", help="chat with a fine-tuned checkpoint (one line a turn; /exit or EOF quits)")
    _common(p)
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a run folder or a step_NNNNNN folder")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (default: the checkpoint's own); must match")
    p.add_argument("--system", default=None, help="a system message that opens the conversation")
    p.add_argument("--max-new-tokens", type=int, help="default: generate.max_new_tokens")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--greedy", action="store_true", help="argmax decoding")
    p.add_argument("--seed", type=int, default=None)

    p = sub.add_parser("eval", help="held-out loss, perplexity and bits per byte of a checkpoint")
    _common(p, "write the results as JSON to this file")
    p.add_argument("--checkpoint", required=True, metavar="DIR")
    p.add_argument("--data", metavar="DIR", help="prepared data folder (default: the checkpoint's data.dir)")
    p.add_argument("--split", default="val", choices=("train", "val"))

    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face Llama folder")
    _common(p, "the Hugging Face folder to write (required)")
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a run folder or a step_NNNNNN folder")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--verify", action="store_true", help="compare logits with transformers (needs lmforge[hf])")

    p = sub.add_parser("import-hf", help="turn a Hugging Face Llama folder into an lmforge checkpoint")
    _common(p, "the lmforge checkpoint folder to write (required)")
    p.add_argument("folder", metavar="DIR", help="a folder written by transformers' save_pretrained")

    p = sub.add_parser("serve", help="an OpenAI-compatible server (batched decoding) with a chat page at /")
    _common(p)
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a run folder or a step_NNNNNN folder")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (default: the checkpoint's own); must match")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument("--max-batch", type=int, default=16, help="requests decoded together at most (default 16)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting at most; beyond: 429 (default 64)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="per-request limit on max_tokens (default: the model's context - 1)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request time limit in seconds (default 120)")

    p = sub.add_parser("speedrun", help="every stage on the embedded corpus, then a summary table")
    _common(p, "output folder (default: runs/speedrun)")
    p.add_argument("--resume", action="store_true", help="keep finished stages, continue pretraining")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def _version() -> str:
    from lmforge import __version__

    return f"lmforge {__version__}"


def _config(args):
    from lmforge.config import load_config

    return load_config(args.config, args.overrides)


def run(args: argparse.Namespace) -> int:
    from lmforge import stages

    cmd = args.command
    if cmd == "train-tokenizer":
        stages.train_tokenizer_stage(_config(args), args.out, progress=not args.no_progress)
    elif cmd == "import-tokenizer":
        from lmforge.tokenizer import import_tokenizer

        out = args.out or _config(args).tokenizer.dir
        tok = import_tokenizer(args.src, out, log=lambda m: print(f"import-tokenizer: {m}", file=sys.stderr))
        print(f"import-tokenizer: {tok.vocab_size} tokens (model vocab {tok.contract.model_vocab_size}), special ids "
              + ", ".join(f"{k}={v} {tok.spellings[k]!r}" for k, v in tok.contract.special_tokens.items())
              + f" -> {out}", file=sys.stderr)
    elif cmd == "prepare":
        stages.prepare_stage(_config(args), args.out, progress=not args.no_progress)
    elif cmd == "pretrain":
        cfg = _config(args)
        if not args.out and not args.dry_run:
            raise LmforgeError("pretrain needs --out DIR (the run folder).")
        last = stages.pretrain_stage(cfg, Path(args.out or "."), resume=args.resume, dry_run=args.dry_run,
                                     progress=not args.no_progress)
        print(json.dumps(last))
    elif cmd == "sft":
        from lmforge.sft import sft_stage  # noqa: F401  (added with the SFT stage)

        cfg = _config(args)
        if not args.out and not args.dry_run:
            raise LmforgeError("sft needs --out DIR (the run folder).")
        last = sft_stage(cfg, Path(args.out or "."), resume=args.resume, dry_run=args.dry_run,
                         progress=not args.no_progress)
        print(json.dumps(last))
    elif cmd == "generate":
        from lmforge.generate import SamplingConfig

        cfg = _config(args)
        model, tok, _ = stages.load_for_inference(args.checkpoint, args.tokenizer)
        sampling = SamplingConfig.from_config(
            cfg.generate, greedy=args.greedy, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty)
        print(stages.generate_text(model, tok, args.prompt, sampling, seed=args.seed, truncate=args.truncate))
    elif cmd == "chat":
        from lmforge.generate import SamplingConfig
        from lmforge.sft import chat_loop, stdin_reader

        g = _config(args).generate
        model, tok, _ = stages.load_for_inference(args.checkpoint, args.tokenizer)
        sampling = SamplingConfig.from_config(
            g, greedy=args.greedy, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p)
        chat_loop(model, tok, sampling, stdin_reader(), lambda reply: print(reply, flush=True),
                  system=args.system, seed=args.seed)
    elif cmd == "eval":
        res = stages.eval_stage(args.checkpoint, args.data, args.split, args.out)
        print(f"loss {res['loss']:.4f} nats/token, perplexity {res['perplexity']:.2f}, "
              f"{res['bits_per_byte']:.4f} bits/byte over {res['tokens']:,} tokens ({res['bytes']:,} bytes)")
        print(json.dumps(res))
    elif cmd == "export":
        from lmforge.export import export_hf

        if not args.out:
            raise LmforgeError("export needs --out DIR (the Hugging Face folder to write).")
        print(export_hf(args.checkpoint, args.out, dtype=args.dtype, verify=args.verify))
    elif cmd == "import-hf":
        from lmforge.export import import_hf

        if not args.out:
            raise LmforgeError("import-hf needs --out DIR (the lmforge checkpoint folder to write).")
        print(import_hf(args.folder, args.out, log=lambda msg: print(f"import-hf: {msg}", file=sys.stderr)))
    elif cmd == "serve":
        from lmforge.serve import serve

        serve(args.checkpoint, args.host, args.port, args.tokenizer, max_batch=args.max_batch,
              max_queue=args.max_queue, max_tokens=args.max_tokens, timeout_s=args.timeout)
    elif cmd == "speedrun":
        from lmforge.speedrun import speedrun

        speedrun(_config(args), args.out or "runs/speedrun", resume=args.resume, progress=not args.no_progress)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except LmforgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: checkpoints are kept; run the same command with --resume to continue "
              "(`make speedrun` resumes by itself)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
