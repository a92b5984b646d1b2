"""What a data.source names, listed: the files it is read from, in reading order, each with its size
and modification time (`list_inputs` -> `InputFile`), for every kind of source: the standard
library's modules (`stdlib_root`), a folder of text files and record shards, a glob, one file, a
`datasets` save_to_disk folder (`save_to_disk_files`), or a dataset of the local Hugging Face
cache (`hf_snapshot`); what a listing passes over is counted and named (`SourceStats`).
`sources.py` reads the documents out of these files.
"""

from __future__ import annotations

import os
import stat
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.data.records import RECORD_SUFFIXES, record_suffix
from lmforge.errors import DataError, os_error, require_package
from lmforge.fileio import shown_path

TEXT_SUFFIXES = (".txt", ".md", ".py")
#: Names of skipped files kept at most (the counts are complete).
SKIPPED_NAMES = 100


@dataclass
class SourceStats:
    documents: int = 0
    bad_utf8: int = 0
    empty: int = 0
    not_regular: int = 0
    """Files with a corpus suffix that are not regular files (a FIFO, a device, a link to one): never read."""
    other: int = 0
    """What a folder (or a glob) holds that is not read: a file of another type (a compressed text file
    or a format lmforge does not read included), a link to a folder (never followed), a hidden folder."""
    skipped_names: list[str] = field(default_factory=list)
    """The first SKIPPED_NAMES of every file or folder skipped (each kind above), in listing order."""
    input_bytes: int = 0
    """Bytes on disk of every file the source lists (known once the first document is read)."""
    input_done: int = 0
    """Bytes on disk of the files read to their end."""
    position: Callable[[], int] | None = None
    """Bytes on disk of the file being read that are read so far (None: not known within the file)."""

    def skip(self, name: str) -> None:
        if len(self.skipped_names) < SKIPPED_NAMES:
            self.skipped_names.append(name)

    def input_read(self) -> int:
        """Bytes on disk read so far, for progress: whole files, and the part of the current one."""
        return self.input_done + (self.position() if self.position is not None else 0)


@dataclass(frozen=True)
class InputFile:
    """A file a source lists: `kind` "module" (a stdlib module, named by its path under the
    library), "text" (one document keyed by `rel`) or "records" (a shard, a document a record);
    its size and modification time when listed (a file that changes before it is read to its end
    is an error: the corpus would be another than the one listed)."""

    path: Path
    rel: str
    kind: str
    size: int
    mtime_ns: int


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _unlistable(exc: OSError) -> None:
    """os.walk skips a folder it cannot list; a corpus never silently loses one."""
    raise os_error(exc, doing="list", what="Its files would be missing from the corpus.")


def _walk(root: Path, suffixes: tuple[str, ...], skip_dirs: set[str], stats: "SourceStats | None" = None,
          name_others: bool = False) -> Iterator[Path]:
    """The files under `root` whose names end in `suffixes`, in sorted order, never in `skip_dirs`
    or a hidden folder. `name_others` (a user's corpus folder): every other file, every hidden
    folder and every link to a folder (os.walk never follows one) is counted and named in `stats`,
    so a folder never loses a file without a word."""
    for dirpath, dirnames, filenames in os.walk(root, onerror=_unlistable):
        kept = []
        for d in sorted(dirnames):
            if d in skip_dirs:
                continue
            linked = os.path.islink(os.path.join(dirpath, d))
            if d.startswith(".") or linked:
                if name_others and stats is not None:
                    stats.other += 1
                    stats.skip(shown_path(Path(dirpath) / d))
                continue
            kept.append(d)
        dirnames[:] = kept
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if not name.endswith(suffixes):
                if name_others and stats is not None:
                    stats.other += 1
                    stats.skip(shown_path(path))
                continue
            # regular files only, never read otherwise: a FIFO, a device or a link to one named *.txt would
            # block the read forever or never end (/dev/zero); each is counted and named in the report
            try:
                regular = stat.S_ISREG(path.stat().st_mode)
            except OSError:  # a broken link or a loop: _read_text names the system's reason
                regular = True
            if regular:
                yield path
            elif stats is not None:
                stats.not_regular += 1
                stats.skip(shown_path(path))


#: What data.source may be, for error messages.
SOURCE_HELP = (f"Use \"stdlib\", a folder of {'/'.join(TEXT_SUFFIXES)} files or record shards "
               f"({', '.join(RECORD_SUFFIXES)}), a glob of them (\"corpus/*.parquet\"), one such file, a folder "
               f"written by datasets' save_to_disk, or \"hf:OWNER/NAME\" (a dataset in the local Hugging Face cache)")


#: data.source naming a dataset of the local Hugging Face hub cache: "hf:OWNER/NAME[@REVISION][:PATH]".
HF_PREFIX = "hf:"


def hf_snapshot(source: str) -> str:
    """The local path that data.source = "hf:OWNER/NAME[@REVISION][:PATH]" names: the snapshot
    folder of that dataset repository in the Hugging Face hub cache (`HF_HUB_CACHE`, else
    huggingface_hub's default), found by huggingface_hub itself with local files only, or PATH
    inside it (a subfolder, a file or a glob such as `data/train-*.parquet`). Never downloads.

    Raises:
        DataError: a malformed name, or a dataset (or revision) that is not in the cache, with the
        command that downloads it.
    """
    import re

    repo, _, path = source[len(HF_PREFIX):].partition(":")
    repo, _, revision = repo.partition("@")
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", repo):
        raise DataError(f"data.source = {source!r}: expected hf:OWNER/NAME, hf:OWNER/NAME@REVISION or "
                        f"hf:OWNER/NAME:PATH (a subfolder, file or glob inside the dataset), e.g. "
                        f"\"hf:HuggingFaceFW/fineweb-edu:sample/10BT/*.parquet\".")
    hub = require_package("huggingface_hub", "huggingface_hub", f"data.source = {source!r}", DataError)
    cache = os.environ.get("HF_HUB_CACHE") or None
    try:
        folder = hub.snapshot_download(repo, repo_type="dataset", revision=revision or None, cache_dir=cache,
                                       local_files_only=True)
    except (OSError, ValueError) as exc:  # LocalEntryNotFoundError is a FileNotFoundError
        where = cache or hub.constants.HF_HUB_CACHE
        what = f"{repo} (revision {revision})" if revision else repo
        raise DataError(f"data.source = {source!r}: the dataset {what} is not in the local Hugging Face cache "
                        f"({where}; {type(exc).__name__}). lmforge never downloads at run time: download it first "
                        f"with `hf download {repo} --repo-type dataset{' --revision ' + revision if revision else ''}` "
                        f"(huggingface_hub's command line; set HF_HUB_CACHE to use another cache), then run "
                        f"again.") from None
    return str(Path(folder) / path) if path else str(folder)


def source_path(source: str) -> str | None:
    """The file or folder a data.source reads from, for the check that no output is one of the
    inputs: itself, or a glob's leading folder; None for "stdlib" and a Hugging Face cache name."""
    if not source or source == "stdlib" or source.startswith(HF_PREFIX):
        return None
    if is_glob(source) and not Path(source).exists():
        return str(_glob_base(source))
    return source


def is_glob(source: str) -> bool:
    return any(c in source for c in "*?[")


def save_to_disk_files(folder: Path) -> list[Path] | None:
    """The Arrow files of a `datasets` save_to_disk folder in its own order (state.json's
    `_data_files`), or None when `folder` is not one.

    Raises:
        DataError: a state.json that is not readable JSON or names a file that is missing.
    """
    import json

    state = folder / "state.json"
    try:
        if not (state.is_file() and (folder / "dataset_info.json").is_file()):
            return None
    except OSError:  # a folder that cannot be listed: the walk names the system's reason
        return None
    try:
        files = [folder / f["filename"] for f in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{shown_path(state)}: not the state.json of a datasets save_to_disk folder ({exc}). "
                        f"Save the dataset again.") from None
    for f in files:
        if not f.is_file():
            raise DataError(f"{shown_path(state)} names {f.name}, which {folder} does not hold. Save the dataset "
                            f"again.")
    return files


def list_inputs(source: str, include_tests: bool = False, stats: SourceStats | None = None) -> list[InputFile]:
    """Every file `source` is read from, in reading order (module docstring of `iter_documents`),
    with its size and modification time.

    Raises:
        DataError: a source that does not exist, a glob that matches nothing, a folder with no
        corpus file, an unsupported file type, a save_to_disk folder whose state.json is bad.
    """
    if source.startswith(HF_PREFIX):
        source = hf_snapshot(source)
    if source == "stdlib":
        root = stdlib_root()
        skip = {"site-packages", "dist-packages", "__pycache__"}
        if not include_tests:
            skip |= {"test", "tests"}
        return [_listed(path, str(path.relative_to(root)), "module") for path in _walk(root, (".py",), skip, stats)]
    path = Path(source)
    if is_glob(source) and not path.exists():
        import glob

        matches = sorted(Path(f) for f in glob.glob(source, recursive=True))
        files = [f for f in matches if _corpus_kind(f) is not None]
        if stats is not None:  # a match that is not a corpus file is named, never dropped without a word
            for f in matches:
                if _corpus_kind(f) is None and not f.is_dir():
                    stats.other += 1
                    stats.skip(shown_path(f))
        if not files:
            raise DataError(f"data.source = {source!r} matches no {'/'.join(TEXT_SUFFIXES)} file or record shard "
                            f"({', '.join(RECORD_SUFFIXES)}). {SOURCE_HELP}.")
        base = _glob_base(source)
        return [_listed(f, _relative(f, base), _corpus_kind(f)) for f in files]
    if not path.exists():
        raise DataError(f"data.source = {source!r} does not exist. {SOURCE_HELP}.")
    if path.is_dir():
        arrow = save_to_disk_files(path)
        if arrow is not None:
            return [_listed(f, f.name, "records") for f in arrow]
        files = [_listed(f, _relative(f, path), _corpus_kind(f))
                 for f in _walk(path, TEXT_SUFFIXES + RECORD_SUFFIXES, {"__pycache__"}, stats, name_others=True)]
        if not files:
            held = f" (it holds {stats.other} other: {', '.join(stats.skipped_names[:3])})" \
                if stats is not None and stats.other else ""
            raise DataError(f"data.source folder {path} holds no {'/'.join(TEXT_SUFFIXES)} files and no record "
                            f"shards ({', '.join(RECORD_SUFFIXES)}){held}. Add some, or point data.source elsewhere.")
        return files
    if _corpus_kind(path) is None:
        raise DataError(f"data.source = {source!r}: unsupported file type {path.suffix!r}. {SOURCE_HELP}.")
    return [_listed(path, path.name, _corpus_kind(path))]


def _listed(path: Path, rel: str, kind: str) -> InputFile:
    try:
        st = path.stat()
        size, mtime = st.st_size, st.st_mtime_ns
    except OSError:  # a broken link or a loop: reading it names the system's reason
        size, mtime = 0, 0
    return InputFile(path, rel, kind, size, mtime)


def _corpus_kind(path: Path) -> str | None:
    """"records", "text" or None (not a corpus file), by the end of the name."""
    if record_suffix(path) is not None:
        return "records"
    return "text" if path.name.endswith(TEXT_SUFFIXES) else None


def _glob_base(pattern: str) -> Path:
    """The folder a glob's matches are named from: its leading parts without a wildcard."""
    parts = []
    for part in Path(pattern).parts:
        if is_glob(part):
            break
        parts.append(part)
    return Path(*parts) if parts else Path(".")


def _relative(file: Path, base: Path) -> str:
    """A text file's name and split key: its path from the source's folder (a glob's matches all
    start with its leading parts, `_glob_base`)."""
    return shown_path(file.relative_to(base).as_posix())


__all__ = ["HF_PREFIX", "InputFile", "SOURCE_HELP", "SourceStats", "TEXT_SUFFIXES", "hf_snapshot", "is_glob",
           "list_inputs", "save_to_disk_files", "source_path", "stdlib_root"]
