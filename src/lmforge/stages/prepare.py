"""`lmforge prepare`: pretokenize `data.source` into .bin/.idx shards (lmforge.data.shards)."""

from __future__ import annotations

from pathlib import Path

from lmforge.config import CONFIG_FILE, Config
from lmforge.data.reports import data_report_lines
from lmforge.data.shards import prepare
from lmforge.stages.common import log
from lmforge.tokenizer import Tokenizer


def prepare_stage(cfg: Config, out: str | Path | None = None, progress: bool = True) -> dict:
    """Pretokenize `data.source` with the tokenizer in tokenizer.dir into `out` (or data.dir)."""
    out = Path(out or cfg.data.dir)
    tok = Tokenizer.load(cfg.tokenizer.dir)
    d = cfg.data
    meta = prepare(d.source, tok, out, d.val_fraction, d.include_tests, d.on_bad_utf8, progress,
                   extra_files={CONFIG_FILE: cfg.to_toml()}, seq_len=d.seq_len, text_field=d.text_field)
    for split, m in meta["splits"].items():
        log(f"prepare: {split}: {m['documents']} documents, {m['tokens']:,} tokens, {m['bytes']:,} bytes "
            f"({m['bytes'] / max(1, m['tokens'] - 2 * m['documents']):.2f} bytes/token)")
    skipped = {k: meta[k] for k in ("skipped_bad_utf8", "skipped_empty", "skipped_duplicates", "skipped_not_regular")
               if meta.get(k)}
    if skipped:
        names = meta.get("skipped_names") or []
        log(f"prepare: skipped {skipped}" + (f" (files: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}; "
                                            f"all in meta.json)" if names else ""))
    log(data_report_lines(meta["report"]))
    return meta
