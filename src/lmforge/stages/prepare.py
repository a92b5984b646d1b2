"""`lmforge prepare`: pretokenize `data.source` (or each of `data.sources`, a weighted mixture)
into .bin/.idx shards (lmforge.data.prepare, lmforge.data.mixture)."""

from __future__ import annotations

from pathlib import Path

from lmforge.config import CONFIG_FILE, Config
from lmforge.errors import ConfigError
from lmforge.data.mixture import mixture_sources, prepare_mixture
from lmforge.data.reports import data_report_lines
from lmforge.data.inputs import source_path
from lmforge.data.prepare import PREPARE_OUTPUT, prepare
from lmforge.data.quality import Quality
from lmforge.fileio import check_not_input, check_output
from lmforge.stages.common import log
from lmforge.tokenizer import Tokenizer


def prepare_stage(cfg: Config, out: str | Path | None = None, progress: bool = True, executor: str = "local") -> dict:
    """Pretokenize `data.source` with the tokenizer in tokenizer.dir into `out` (or data.dir);
    with `data.sources`, each source into `out`/NAME (a source prepared before from the same
    files and settings is reused). `executor` "ray": data.source's tasks on a Ray cluster
    (data.executor.address, else one started here). Returns the meta dict (a mixture: {name: meta})."""
    out = Path(out or cfg.data.dir)
    tok = Tokenizer.load(cfg.tokenizer.dir)
    d = cfg.data
    # never an input: not the corpus, not inside a corpus folder, never holding one (the folder is replaced whole)
    inputs = [("tokenizer.dir", cfg.tokenizer.dir)]
    if d.sources:
        inputs += [(f"data.sources[{i}].source", source_path(e.get("source")))
                   for i, e in enumerate(d.sources) if isinstance(e, dict) and isinstance(e.get("source"), str)]
    else:
        inputs.append(("data.source", source_path(d.source)))
    check_not_input(out, inputs, own_check=lambda: check_output(out, PREPARE_OUTPUT, "`lmforge prepare`",
                                                                replace_whole=True))
    extra = {CONFIG_FILE: cfg.to_toml()}
    quality = Quality(tuple(d.filters), d.dedup)
    if d.sources and executor != "local":
        raise ConfigError(f"data.sources: a mixture of {len(d.sources)} sources; `lmforge prepare --executor "
                          f"{executor}` prepares one data.source. Prepare the mixture without --executor.")
    if d.sources:
        sources = mixture_sources(d.sources)
        metas = prepare_mixture(sources, tok, out, d.val_fraction, d.include_tests, d.on_bad_utf8, progress,
                                extra_files=extra, seq_len=d.seq_len, log=log, workers=d.workers,
                                quality=quality)
        for name, meta in metas.items():
            _summary(meta, f"prepare: {name}: ")
        log(f"prepare: a mixture of {len(metas)} sources in {out} ({sum(m['reused'] for m in metas.values())} "
            f"reused); pretraining draws rows by data.sources' weights")
        return metas
    workers = d.workers
    if executor == "ray":  # the tasks asked for, on the cluster's cores (never fewer for a small input)
        from lmforge.data.fast_encode import cores

        workers = d.executor.get("tasks") or d.workers or cores()
    meta = prepare(d.source, tok, out, d.val_fraction, d.include_tests, d.on_bad_utf8, progress,
                   extra_files=extra, seq_len=d.seq_len, text_field=d.text_field, workers=workers, executor=executor,
                   address=d.executor.get("address", ""), quality=quality)
    _summary(meta, "prepare: ")
    return meta


def _summary(meta: dict, prefix: str) -> None:
    for split, m in meta["splits"].items():
        log(f"{prefix}{split}: {m['documents']} documents, {m['tokens']:,} tokens, {m['bytes']:,} bytes "
            f"({m['bytes'] / max(1, m['tokens'] - 2 * m['documents']):.2f} bytes/token)")
    skipped = {k: meta[k] for k in ("skipped_bad_utf8", "skipped_empty", "skipped_duplicates", "skipped_not_regular",
                                    "skipped_other", "skipped_filtered", "skipped_near_duplicates") if meta.get(k)}
    if skipped:
        names = meta.get("skipped_names") or []
        log(f"{prefix}skipped {skipped}" + (f" (files: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}; "
                                            f"all in meta.json)" if names else ""))
    if meta.get("report"):
        log(data_report_lines(meta["report"]))
