"""Tokenizer training: lmforge's `train_tokenizer` vs sentencepiece BPE, same vocab size.

Both train on the training split of the standard-library corpus (what `make speedrun`
trains on) to a vocabulary of 8192, run interleaved, and are timed from the documents in
memory to a saved model. lmforge: HF `tokenizers` byte-level BPE with Qwen2's split,
tokens capped at 32 bytes, 5 special tokens. sentencepiece: `model_type=bpe`, fed one
line at a time (its unit is a sentence), byte fallback, digits split, identity
normalization, whitespace kept, all cores. MB/s counts the UTF-8 bytes of the documents.
The last column is the compression each gets on the held-out split (UTF-8 bytes per
token; higher is better).

Run: `python bench/bench_tokenizer.py [--repeat 2] [--vocab 8192]`; `--smoke`: vocab 512 on a
0.2 MB corpus, seconds (proves the benchmark runs; the cache is left alone).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def sentencepiece_trainer(texts: list[str], vocab: int, folder: Path):
    """A callable that trains sentencepiece BPE on `texts` into `folder`/sp.model, or None
    when sentencepiece is not installed."""
    try:
        import sentencepiece as spm
    except ImportError:
        return None

    def train():
        lines = (line for t in texts for line in t.split("\n") if line.strip())
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines, model_prefix=str(folder / "sp"), vocab_size=vocab, model_type="bpe",
            byte_fallback=True, character_coverage=0.9995, split_digits=True, remove_extra_whitespaces=False,
            normalization_rule_name="identity", allow_whitespace_only_pieces=True, num_threads=common.cores(),
            input_sentence_size=0, max_sentence_length=1 << 16, minloglevel=2,
        )
    return train


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=2)
    common.smoke_flag(ap)
    args = ap.parse_args([] if argv is None else argv)
    from lmforge.tokenizer import Tokenizer, train_tokenizer

    t_start = time.perf_counter()
    if args.smoke:
        args.vocab, args.repeat = 512, 1
        texts = common.smoke_texts(80)
        train_texts, val_texts = texts[:60], texts[60:]
    else:
        train_texts = common.stdlib_texts("train")
        val_texts = common.stdlib_texts("val")
    mb = sum(len(t.encode("utf-8")) for t in train_texts) / 1e6
    val_bytes = sum(len(t.encode("utf-8")) for t in val_texts)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        fns = {"lmforge train_tokenizer": lambda: train_tokenizer(iter(train_texts), args.vocab, work / "lmforge",
                                                                   show_progress=False)}
        sp_train = sentencepiece_trainer(train_texts, args.vocab, work)
        if sp_train is not None:
            fns["sentencepiece BPE"] = sp_train
        times = common.interleaved(fns, 0, args.repeat)
        tok = Tokenizer.load(work / "lmforge")
        compression = {"lmforge train_tokenizer": val_bytes / sum(len(x) for x in tok.encode_batch(val_texts))}
        if sp_train is not None:
            import sentencepiece as spm

            sp = spm.SentencePieceProcessor(model_file=str(work / "sp.model"))
            compression["sentencepiece BPE"] = val_bytes / sum(len(x) for x in sp.encode(val_texts))
        cached = common.CACHE / f"tokenizer-stdlib-{args.vocab}"
        if not cached.exists() and not args.smoke:  # bench_data reuses it
            cached.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(work / "lmforge", cached)

    ref = times.get("sentencepiece BPE")
    rows = []
    for name, s in times.items():
        rate = s.rate(mb)
        rows.append((name, f"{s.median:.1f}", s.spread("{:.1f}"), f"{rate.median:.2f}",
                     f"{ref.median / s.median:.2f}x" if ref else "-", f"{compression[name]:.2f}"))
    if ref is None:
        rows.append(("sentencepiece BPE", "not installed (pip install sentencepiece)", "-", "-", "-", "-"))
    table = common.table(
        ["trainer", "seconds (median)", "min-max", "MB/s", "speed vs sentencepiece", "val bytes/token"], rows,
        title=f"Tokenizer training on the {'smoke corpus' if args.smoke else 'stdlib train split'} ({mb:.1f} MB, "
              f"{len(train_texts)} documents, vocab {args.vocab})" + (" (SMOKE RUN: figures mean nothing)"
                                                                      if args.smoke else ""))
    notes = [f"{args.repeat} interleaved runs each, no warm-up; {common.cores()} cores.",
             "sentencepiece sees lines (its sentences); lmforge sees whole documents split by the Qwen2 regex."]
    print(table + "\n\n" + "\n".join(f"- {n}" for n in notes), flush=True)
    return {"benchmark": "tokenizer", "corpus_mb": mb, "vocab": args.vocab,
            "seconds": {k: s.as_dict() for k, s in times.items()},
            "mb_per_s": {k: mb / s.median for k, s in times.items()},
            "val_bytes_per_token": compression, "sentencepiece_installed": ref is not None,
            "wall_s": round(time.perf_counter() - t_start, 1)}


if __name__ == "__main__":
    main(sys.argv[1:])
