"""Weighted mixtures of corpora (`data.sources`): each source prepared once, rows drawn by weight.

`data.sources` lists tables {source, weight = 1, text_field = "text", name}; `source` is anything
`data.source` takes (lmforge.data.sources).

Preparing (`prepare_mixture`) writes data.dir as one folder (through `fileio.atomic_dir`, so an interrupted
prepare leaves the previous folder as it was) holding a prepared folder per source, `data.dir/NAME/`
({train,val}.{bin,idx}, contract.json, meta.json, report.json, as `lmforge.data.prepare.prepare` writes them),
and `mixture.json` (the sources, in order). A source whose folder in the previous data.dir was prepared from
the same files (path, size and modification time of each, `listing_fingerprint`) with the same settings and
tokenizer is reused as it is (hard links), so changing the weights, or adding a source, tokenizes nothing
twice. Weights are not part of the prepared folder: pretraining reads them.

Drawing (`MixtureStream`): every source has its own `RowStream` (its documents packed into rows, epoch after
epoch, shuffled by its own seed), and the global row sequence takes its k-th row from the source with the largest
deficit (k + 1) * p_i - n_i(k), p_i = weight_i / sum of weights and n_i(k) the rows source i gave to the first k
(ties: the first listed). It is deterministic, a pure function of the weights, and exact: every source's deficit
stays above -1, so with two sources |n_i(k) - k p_i| < 1 at every k (3:1 gives 3 rows of the one and 1 of the
other in every 4), and with integer weights the pattern repeats every sum-of-weights rows (the weights in lowest
terms). The state is the row count and each source's count, so `--resume` continues exactly, on any number of
ranks (the k-th global row is the same one whatever the world size, as for `RowStream`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import reduce
from pathlib import Path

import numpy as np

from lmforge.data.packing import Batch, RowStream, collate
from lmforge.data.records import record_suffix
from lmforge.data.inputs import HF_PREFIX, TEXT_SUFFIXES, SourceStats, hf_snapshot, is_glob, stdlib_root
from lmforge.data.prepare import PREPARE_OUTPUT, prepare_into
from lmforge.data.quality import Quality
from lmforge.data.shards import MIXTURE_FILE, read_hashes, read_mixture
from lmforge.data.sources import Document, capped, iter_documents
from lmforge.errors import DataError
from lmforge.fileio import shown_path

#: Beyond this many rows a period of the pattern, `mixture_counts` gives the rounded shares.
MAX_EXACT_PERIOD = 10_000_000


@dataclass(frozen=True)
class MixSource:
    """One entry of data.sources, with its defaults filled in and its folder name."""

    name: str
    source: str
    text_field: str
    weight: float


def mixture_sources(entries: Sequence[dict]) -> list[MixSource]:
    """data.sources as MixSource, in order. A source without a `name` is named after its path
    (`corpus/web/*.parquet` -> `web`, `code.jsonl.zst` -> `code`), with -2, -3, ... where two
    would share one; a name given is kept."""
    taken = {e["name"] for e in entries if e.get("name")}
    out = []
    for e in entries:
        name = e.get("name")
        if not name:
            base = _slug(e["source"])
            name, n = base, 2
            while name in taken:
                name, n = f"{base}-{n}", n + 1
            taken.add(name)
        out.append(MixSource(name, e["source"], e.get("text_field", "text"), float(e.get("weight", 1))))
    return out


def _slug(source: str) -> str:
    parts = [p for p in Path(source).parts if not is_glob(p) and p not in ("/", ".", "..")]
    last = parts[-1] if parts else "source"
    suffix = record_suffix(last) or next((s for s in TEXT_SUFFIXES if last.endswith(s)), "")
    last = last[: len(last) - len(suffix)] if suffix and len(last) > len(suffix) else last
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", last).strip("-.") or "source"
    return slug[:48]


def integer_weights(weights: Sequence[float]) -> list[int]:
    """The weights as integers in the same ratios, in lowest terms (3.0, 1.0 -> 3, 1;
    0.5, 0.25 -> 2, 1; 0.7, 0.3 -> 7, 3): each weight read as the decimal it is written as
    (its shortest repr), so the pattern repeats every 10 rows for 0.7 and 0.3."""
    fracs = [Fraction(repr(float(w))) for w in weights]
    lcm = reduce(lambda a, b: a * b // math.gcd(a, b), (f.denominator for f in fracs), 1)
    ints = [int(f * lcm) for f in fracs]
    g = reduce(math.gcd, ints)
    return [i // g for i in ints]


def next_source(k: int, counts: Sequence[int], weights: Sequence[int]) -> int:
    """The source of global row k (0-based) given the rows each source gave to rows 0..k-1:
    the largest deficit (k + 1) * w_i / W - counts_i, ties to the first (integer arithmetic,
    scaled by W = sum of weights)."""
    total = sum(weights)
    best, best_d = 0, None
    for i, w in enumerate(weights):
        d = (k + 1) * w - counts[i] * total
        if best_d is None or d > best_d:
            best, best_d = i, d
    return best


def mixture_counts(rows: int, weights: Sequence[int]) -> tuple[list[int], bool]:
    """(rows each source gives to the first `rows` global rows, exact). Exact through the
    pattern's period (the sum of the integer weights) up to MAX_EXACT_PERIOD; beyond it, the
    shares rounded (then off by less than one row each, module docstring), with False."""
    period = sum(weights)
    if period > MAX_EXACT_PERIOD:
        counts = [int(rows * w // period) for w in weights]
        return counts, False
    full, rest = divmod(rows, period)
    counts = [0] * len(weights)
    for k in range(rest):
        counts[next_source(k, counts, weights)] += 1
    return [full * w + c for w, c in zip(weights, counts)], True


class MixtureStream:
    """Micro-batches whose rows come from several sources' `RowStream`s by weight (module
    docstring). Each stream in `streams` is a whole row sequence (micro_batch_size 1, rank 0 of
    1): this stream deals the global rows out to the ranks as `RowStream` does, the j-th
    micro-batch of rank r being global rows [(j * W + r) * B, (j * W + r + 1) * B)."""

    def __init__(self, streams: Sequence[RowStream], sources: Sequence[MixSource], micro_batch_size: int,
                 rank: int = 0, world_size: int = 1):
        if len(streams) != len(sources) or not streams:
            raise DataError(f"a mixture needs one row stream per source: {len(streams)} streams, {len(sources)} sources")
        self.streams, self.sources = list(streams), list(sources)
        self.weights = integer_weights([s.weight for s in sources])
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        self.rows, self.counts = 0, [0] * len(streams)
        first = self.streams[0]
        self.seq_len, self.pad_id, self.document_masking = first.seq_len, first.pad_id, first.document_masking

    @property
    def shares(self) -> list[float]:
        total = sum(self.weights)
        return [w / total for w in self.weights]

    def _deal(self, n: int) -> tuple[list[tuple[int, int]], list[int]]:
        """The next `n` global rows as (source, offset past that source's position), and the
        counts after them."""
        counts, out = list(self.counts), []
        for k in range(self.rows, self.rows + n):
            i = next_source(k, counts, self.weights)
            out.append((i, counts[i] - self.counts[i]))
            counts[i] += 1
        return out, counts

    def next_batch(self) -> Batch:
        B = self.micro_batch_size
        dealt, counts = self._deal(self.world_size * B)
        rows = [self.streams[i].build(self.streams[i].peek(offset))
                for i, offset in dealt[self.rank * B: (self.rank + 1) * B]]
        for i, s in enumerate(self.streams):
            s.advance(counts[i] - self.counts[i])
        self.rows += self.world_size * B
        self.counts = counts
        return collate(rows)

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"rows": self.rows, "counts": list(self.counts), "sources": [s.state_dict() for s in self.streams]}

    def load_state_dict(self, state: dict) -> None:
        """Continue at a saved position.

        Raises:
            DataError: a position of another mixture (another number of sources, counts that do
            not add up to the rows, a source position past its rows).
        """
        rows, counts, positions = state.get("rows"), state.get("counts"), state.get("sources")
        if (not isinstance(rows, int) or not isinstance(counts, list) or not isinstance(positions, list)
                or len(counts) != len(self.streams) or len(positions) != len(self.streams)
                or not all(isinstance(c, int) and c >= 0 for c in counts) or sum(counts) != rows):
            raise DataError(f"data position {str(state)[:200]}: not a position of this mixture of "
                            f"{len(self.streams)} sources (rows, counts per source that add up to them, a position "
                            f"per source). The checkpoint is of another data.sources, or damaged.")
        for s, pos in zip(self.streams, positions):
            s.load_state_dict(pos)
        self.rows, self.counts = rows, list(counts)

    def plan_report(self, rows: int) -> dict:
        """What a run of `rows` global rows draws: per source its weight, share, rows, realised
        share, rows an epoch and the epochs that makes (plan.json's "mixture")."""
        counts, exact = mixture_counts(rows, self.weights)
        out = []
        for src, s, share, n in zip(self.sources, self.streams, self.shares, counts):
            per_epoch = s.rows_per_epoch()
            out.append({"name": src.name, "source": src.source, "weight": src.weight, "share": round(share, 6),
                        "rows": n, "realised_share": round(n / max(rows, 1), 6), "rows_per_epoch": per_epoch,
                        "epochs": round(n / max(per_epoch, 1), 3)})
        return {"rows": rows, "exact": exact, "sources": out}

    def epoch_report(self) -> str:
        """The start-up lines: every source's share and its rows (`RowStream.epoch_report`)."""
        lines = [f"mixture: {len(self.sources)} sources, rows drawn by weight "
                 + ", ".join(f"{s.name} {s.weight:g} ({100 * p:.1f}%)" for s, p in zip(self.sources, self.shares))]
        for src, s in zip(self.sources, self.streams):
            lines.append(f"{src.name}: {s.epoch_report()}")
        return "\n".join(lines)


def mixture_lines(report: dict, tokens_per_row: int) -> str:
    """The start-up lines of `MixtureStream.plan_report`: realised shares and repeats."""
    lines = []
    for s in report["sources"]:
        line = (f"mixture: {s['name']}: {s['rows']:,} of {report['rows']:,} rows "
                f"({100 * s['realised_share']:.2f}%, weight share {100 * s['share']:.2f}%), about "
                f"{s['rows'] * tokens_per_row:,} tokens, {s['epochs']:.2f} epochs of its {s['rows_per_epoch']:,} rows")
        if s["epochs"] > 1:
            line += f": it repeats {math.ceil(s['epochs']) - 1} time(s)"
        lines.append(line)
    return "\n".join(lines)


# -- preparing ------------------------------------------------------------------------------------

def listing_fingerprint(source: str) -> str:
    """sha256 of what `source` lists: every file's path, size and modification time (not the
    contents: cheap for any size); "stdlib" by the interpreter's version and library path. A
    source that changed under its name gets another fingerprint, so it is prepared again."""
    h = hashlib.sha256()
    if source.startswith(HF_PREFIX):  # the snapshot's files (a new revision is another folder)
        source = hf_snapshot(source)
    if source == "stdlib":
        h.update(f"stdlib {sys.version} {stdlib_root()}".encode())
        return h.hexdigest()
    path = Path(source)
    if is_glob(source) and not path.exists():
        import glob

        files = sorted(Path(f) for f in glob.glob(source, recursive=True))
    elif path.is_dir():
        files = sorted(Path(d) / f for d, _, names in os.walk(path) for f in names)
    else:
        files = [path]
    for f in files:
        try:
            st = f.stat()
            h.update(os.fsencode(f) + f"\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(os.fsencode(f) + b"\0?\n")
    return h.hexdigest()


def source_input(src: MixSource, val_fraction: float, include_tests: bool, on_bad_utf8: str, quality=Quality()) -> dict:
    """What a source's prepared folder was made from (its meta.json "input"; `quality`'s settings
    when any): a folder whose input equals this one (and whose tokenizer is the same) is reused."""
    return {"source": src.source, "text_field": src.text_field, "val_fraction": val_fraction,
            "include_tests": include_tests, "on_bad_utf8": on_bad_utf8, "files": listing_fingerprint(src.source),
            **quality.settings()}


def _reusable(old: Path, want: dict, contract_text: str) -> Path | None:
    """The folder in the previous data.dir `old` prepared from `want` with this tokenizer, or None."""
    try:
        entries = read_mixture(old) if old.is_dir() else None
    except DataError:  # a damaged previous folder: nothing in it is reused (the new one replaces it)
        return None
    for e in entries or []:
        folder = old / e["name"]
        try:
            meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
            same_tok = (folder / "contract.json").read_text(encoding="utf-8") == contract_text
        except (OSError, ValueError):
            continue
        if same_tok and meta.get("input") == want:
            return folder
    return None


def _link_tree(src: Path, dst: Path) -> None:
    """`dst` as a copy of the folder `src`: hard links where the file system allows, else copies."""
    dst.mkdir()
    for f in sorted(src.iterdir()):
        if f.is_file():
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copy2(f, dst / f.name)


def prepare_mixture(sources: Sequence[MixSource], tokenizer, out_dir: str | Path, val_fraction: float = 0.02,
                    include_tests: bool = False, on_bad_utf8: str = "skip", progress: bool = True,
                    extra_files: dict[str, str] | None = None, seq_len: int = 0, log=print, workers: int = 1,
                    quality: Quality = Quality()) -> dict:
    """Prepare every source into `out_dir`/NAME and write mixture.json (module docstring);
    sources prepared before with the same input are reused; `workers`: tasks at once for each
    (`lmforge.data.parallel`; a stopped run does not resume them); `quality`: each one's filters and
    deduplication. Returns {name: meta} (each with its "report" and "reused": True/False).

    Raises:
        DataError / OutputError: as `lmforge.data.prepare.prepare`, naming the source.
    """
    from lmforge.fileio import atomic_dir

    out = Path(out_dir)
    metas: dict[str, dict] = {}
    with atomic_dir(out, PREPARE_OUTPUT, what="`lmforge prepare`") as tmp:
        tokenizer.contract.save(tmp)
        contract_text = (tmp / "contract.json").read_text(encoding="utf-8")
        for n, src in enumerate(sources, 1):
            want = source_input(src, val_fraction, include_tests, on_bad_utf8, quality)
            old = _reusable(out, want, contract_text)
            folder = tmp / src.name
            if old is not None:
                _link_tree(old, folder)
                meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
                report_path = folder / "report.json"
                meta["report"] = json.loads(report_path.read_text(encoding="utf-8")) if report_path.is_file() else {}
                meta["reused"] = True
                log(f"prepare: source {n}/{len(sources)} {src.name} ({src.source}): unchanged since "
                    f"{shown_path(old)}, reused")
            else:
                log(f"prepare: source {n}/{len(sources)} {src.name} ({src.source}, field {src.text_field!r})")
                folder.mkdir()
                try:
                    meta = prepare_into(folder, src.source, tokenizer, val_fraction, include_tests, on_bad_utf8, progress,
                                        seq_len, src.text_field, want, workers, quality=quality)  # tasks in folder
                except DataError as exc:
                    raise DataError(f"data.sources[{n - 1}] ({src.name}): {exc}") from None
                meta["reused"] = False
            metas[src.name] = meta
        mixture = {"sources": [{"name": s.name, "source": s.source, "text_field": s.text_field,
                                "documents": {k: v["documents"] for k, v in metas[s.name]["splits"].items()},
                                "tokens": {k: v["tokens"] for k, v in metas[s.name]["splits"].items()}}
                               for s in sources]}
        (tmp / MIXTURE_FILE).write_text(json.dumps(mixture, indent=2) + "\n", encoding="utf-8")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
    return metas


def check_mixture_folder(folder: str | Path, sources: Sequence[MixSource]) -> None:
    """`folder` was prepared for exactly these sources (names, paths and fields, in any order).

    Raises:
        DataError: no mixture.json (a single-source folder, or none), or other sources.
    """
    folder = Path(folder)
    entries = read_mixture(folder)
    again = f"Run `lmforge prepare` with this config (data.sources) to prepare {folder}."
    if entries is None:
        what = "a single source's prepared folder" if (folder / "train.bin").is_file() else "not a prepared folder"
        raise DataError(f"data.dir = {shown_path(folder)} is {what}, and data.sources lists {len(sources)} sources. "
                        + again)
    have = {(e.get("name"), e.get("source"), e.get("text_field")) for e in entries}
    for s in sources:
        if (s.name, s.source, s.text_field) not in have:
            raise DataError(f"data.dir = {shown_path(folder)} has no prepared folder for the source {s.name} "
                            f"({s.source!r}, field {s.text_field!r}); it holds "
                            f"{', '.join(str(e.get('name')) for e in entries)}. " + again)


def check_no_leak(folders: Sequence[Path], names: Sequence[str]) -> None:
    """No validation document of one source is a training document of another (by content
    hash; within a source `shards.preflight` checks it).

    Raises:
        DataError: naming both sources.
    """
    hashes = [read_hashes(f) for f in folders]
    for i, (val_i, _) in enumerate(hashes):
        for j, (_, train_j) in enumerate(hashes):
            if i == j or val_i is None or train_j is None:
                continue
            leaked = np.intersect1d(val_i, train_j)
            if len(leaked):
                raise DataError(f"{len(leaked)} validation document(s) of the source {names[i]} are training "
                                f"documents of the source {names[j]} (by content hash): its validation loss would "
                                f"measure trained text. Remove the shared documents from one of them (or give the "
                                f"text files the same relative paths, so they split alike), then re-run `lmforge "
                                f"prepare`.")


def mixture_documents(sources: Sequence[MixSource], split: str | None, val_fraction: float, include_tests: bool,
                      on_bad_utf8: str, stats: SourceStats, max_bytes: int = 0) -> Iterator[Document]:
    """The documents of every source in turn (for the tokenizer), each source's capped at
    `max_bytes` x its share when `max_bytes` > 0."""
    weights = integer_weights([s.weight for s in sources])
    for src, w in zip(sources, weights):
        yield from capped(iter_documents(src.source, split, val_fraction, include_tests, on_bad_utf8, stats,
                                         src.text_field), max_bytes * w / sum(weights))
