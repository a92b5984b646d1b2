"""`lmforge train-tokenizer` and `lmforge import-tokenizer`: write a tokenizer folder
(tokenizer.json, tokenizer_config.json, contract.json, config.toml)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from lmforge.config import CONFIG_FILE, Config
from lmforge.data.mixture import mixture_documents, mixture_sources
from lmforge.data.reports import SAMPLE_BYTES, report_lines, sample, tokenizer_report
from lmforge.data.inputs import SourceStats, source_path
from lmforge.data.sources import capped, iter_documents
from lmforge.errors import LmforgeError
from lmforge.fileio import check_not_input, check_output
from lmforge.stages.common import log
from lmforge.tokenizer import Tokenizer, import_tokenizer, train_tokenizer
from lmforge.tokenizer.train import TOKENIZER_OUTPUT

REPORT_FILE = "report.json"


def train_tokenizer_stage(cfg: Config, out: str | Path | None = None, progress: bool = True) -> Tokenizer:
    """Train the BPE tokenizer on the training split of `data.source` into `out` (or tokenizer.dir).

    The folder's config.toml records the vocabulary actually trained: a corpus too small for
    `tokenizer.vocab_size` yields fewer tokens, and that is said.

    Raises:
        OutputError: `out` is, holds or lies inside data.source (or a data.sources entry), with or
        without --force (`fileio.check_not_input`), or may not be written (`check_output`).
    """
    out = Path(out or cfg.tokenizer.dir)
    d = cfg.data
    # never an input: not the corpus, not inside a corpus folder, never holding one (the folder is replaced whole)
    check_not_input(out, source_inputs(d), own_check=lambda: check_output(out, TOKENIZER_OUTPUT, "the tokenizer stage",
                                                                          replace_whole=True))
    stats = SourceStats()
    budget = cfg.tokenizer.max_train_bytes

    def texts():
        return (doc.text for doc in capped(corpus_documents(d, "train", stats, d.on_bad_utf8, budget), budget))

    t0 = time.perf_counter()
    report: dict = {}
    tok = train_tokenizer(texts(), cfg.tokenizer.vocab_size, out, show_progress=progress,
                          extra_files={CONFIG_FILE: cfg.to_toml(), REPORT_FILE: _report(cfg, report)})
    if tok.vocab_size != cfg.tokenizer.vocab_size:
        log(f"note: tokenizer.vocab_size = {cfg.tokenizer.vocab_size} asked, but the corpus has merges for only "
            f"{tok.vocab_size} tokens; {out / CONFIG_FILE} records {tok.vocab_size}. Use more text for a larger "
            f"vocabulary.")
        cfg = replace(cfg, tokenizer=replace(cfg.tokenizer, vocab_size=tok.vocab_size))
        cfg.save(out / CONFIG_FILE)
    log(f"tokenizer: {tok.vocab_size} tokens (model vocab {tok.contract.model_vocab_size}) trained on "
        f"{stats.documents} documents in {time.perf_counter() - t0:.1f}s -> {out}"
        + (f" ({stats.bad_utf8} non-UTF-8 files skipped)" if stats.bad_utf8 else "")
        + (f" ({stats.not_regular} files that are not regular files skipped, never read)" if stats.not_regular else "")
        + (f" ({stats.empty} empty documents skipped)" if stats.empty else "")
        + (f" ({stats.other} other files or folders not read (skipped_other))" if stats.other else "")
        + (f"; skipped: {', '.join(stats.skipped_names[:3])}{', ...' if len(stats.skipped_names) > 3 else ''}"
           if stats.skipped_names else ""))
    log(report_lines(report))
    return tok


def source_inputs(d) -> list[tuple[str, str | None]]:
    """The corpus a [data] section reads, as `fileio.check_not_input`'s (name, path) pairs: data.source,
    or each data.sources entry's source (a glob's leading folder; none for "stdlib" or a Hugging Face name)."""
    if d.sources:
        return [(f"data.sources[{i}].source", source_path(e.get("source")))
                for i, e in enumerate(d.sources) if isinstance(e, dict) and isinstance(e.get("source"), str)]
    return [("data.source", source_path(d.source))]


def corpus_documents(d, split: str, stats: SourceStats, on_bad_utf8: str, max_bytes: int = 0):
    """The documents of `split` of data.source, or of every data.sources entry (each capped at
    `max_bytes` x its weight's share when `max_bytes` > 0)."""
    if d.sources:
        return mixture_documents(mixture_sources(d.sources), split, d.val_fraction, d.include_tests, on_bad_utf8,
                                 stats, max_bytes)
    return iter_documents(d.source, split, d.val_fraction, d.include_tests, on_bad_utf8, stats, d.text_field)


def _report(cfg: Config, into: dict):
    """report.json's text, computed on the saved (temporary) tokenizer folder: the tokenizer
    report (lmforge.data.reports) on samples of data.source's splits; `into` receives it."""

    def make(folder: Path) -> str:
        d = cfg.data
        tok = Tokenizer.load(folder)
        texts: dict[str, list[str]] = {}
        try:
            for split in ("train", "val"):
                texts[split] = sample(doc.text for doc in corpus_documents(d, split, SourceStats(), "skip",
                                                                           SAMPLE_BYTES))
        except LmforgeError as exc:  # an imported tokenizer with no readable data.source: the vocabulary alone
            texts = {}
            into["text_unavailable"] = str(exc)
        into.update(tokenizer_report(tok, texts))
        return json.dumps(into, indent=2, ensure_ascii=False) + "\n"

    return make


def import_tokenizer_stage(cfg: Config, src: str | Path, out: str | Path | None = None) -> Tokenizer:
    """Derive lmforge's contract from a Hugging Face tokenizer folder into `out` (or tokenizer.dir).
    `out` is never the --from folder, inside it or holding it, nor inside the corpus the report
    samples (data.source)."""
    out = Path(out or cfg.tokenizer.dir)
    report: dict = {}
    tok = import_tokenizer(src, out, log=lambda m: log(f"import-tokenizer: {m}"), eos_token=cfg.tokenizer.eos_token,
                           extra_files={REPORT_FILE: _report(cfg, report)}, inputs=source_inputs(cfg.data))
    log(f"import-tokenizer: {tok.vocab_size} tokens (model vocab {tok.contract.model_vocab_size}), special ids "
        + ", ".join(f"{k}={v} {tok.spellings[k]!r}" for k, v in tok.contract.special_tokens.items()) + f" -> {out}")
    log(report_lines(report))
    return tok
