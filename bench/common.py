"""Shared helpers for the benchmarks in bench/: timing statistics, interleaved runs,
peak-RSS probes, the machine description, tables, and a cached stdlib tokenizer.

Every benchmark runs lmforge and its reference in one process, interleaved round by
round (so a noisy neighbour slows both alike), and reports medians over the measured
repeats after warm-up, with the min-max spread.
"""

from __future__ import annotations

import os
import platform
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:  # run from a fresh clone without `pip install -e .`
    sys.path.insert(0, str(ROOT / "src"))

#: Where benchmarks keep what they may reuse between runs (a trained tokenizer, corpora).
CACHE = Path(os.environ.get("LMFORGE_BENCH_CACHE", ROOT / "runs" / "bench-cache"))


# -- statistics ------------------------------------------------------------------------
class Stats:
    """Median and min-max of repeated measurements (seconds, or any unit)."""

    def __init__(self, samples: Sequence[float]):
        if not samples:
            raise ValueError("Stats needs at least one sample")
        self.samples = list(samples)
        self.median = statistics.median(self.samples)
        self.min = min(self.samples)
        self.max = max(self.samples)

    def rate(self, work: float) -> "Stats":
        """work / time for each sample (e.g. tokens/s from step seconds): min and max swap."""
        return Stats([work / s for s in self.samples])

    def spread(self, fmt: str = "{:,.0f}") -> str:
        return f"{fmt.format(self.min)}-{fmt.format(self.max)}"

    def as_dict(self) -> dict:
        return {"median": self.median, "min": self.min, "max": self.max, "n": len(self.samples)}


def interleaved(fns: dict[str, Callable[[], object]], warmup: int, repeat: int,
                before: Callable[[str], None] | None = None,
                after: Callable[[str], None] | None = None) -> dict[str, Stats]:
    """Run every fn `warmup` times untimed, then `repeat` timed rounds, interleaved.

    Round r runs the fns in order, reversed on odd rounds, so neither side always runs
    right after the other. `before(name)` / `after(name)` wrap each timed call (not
    timed themselves; used for RSS probes). Returns seconds per call, per name.
    """
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeat):
        for n in (names if r % 2 == 0 else names[::-1]):
            if before:
                before(n)
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
            if after:
                after(n)
    return {n: Stats(t) for n, t in times.items()}


# -- memory -----------------------------------------------------------------------------
def _status_kb(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.M)
    return int(m.group(1)) if m else None


def rss_mb() -> float:
    """Current resident set size of this process, MB (0 where /proc is missing)."""
    kb = _status_kb("VmRSS")
    return (kb or 0) / 1024


def peak_rss_mb() -> float:
    """Peak resident set size of this process since start (or since `reset_peak_rss`), MB."""
    kb = _status_kb("VmHWM")
    if kb is None:  # not Linux: ru_maxrss (kB on Linux, bytes on macOS), never reset
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return r / (1024 * 1024) if sys.platform == "darwin" else r / 1024
    return kb / 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux: write 5 to /proc/self/clear_refs).
    Returns False where that is not allowed (the peak then covers the whole process)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_free_memory() -> None:
    """Hand freed heap pages back to the kernel (glibc `malloc_trim`), so that RSS measures
    live memory rather than what the allocator keeps cached. A no-op elsewhere."""
    global _libc
    if _libc is None:
        try:
            import ctypes

            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_libc = None


class PeakRSS:
    """Per-name peak RSS over repeated calls: `before(name)` trims the heap and resets the
    mark, `after(name)` reads it. When the mark cannot be reset, every name gets the
    process's peak."""

    def __init__(self):
        self.peak: dict[str, float] = {}
        self.resettable = reset_peak_rss()

    def before(self, name: str) -> None:
        release_free_memory()
        reset_peak_rss()

    def after(self, name: str) -> None:
        self.peak[name] = max(self.peak.get(name, 0.0), peak_rss_mb())


# -- the machine ---------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _version(mod: str) -> str:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return "-"


def machine() -> dict:
    """CPU model, cores, torch threads and versions, for the results file."""
    import torch

    info = {
        "cpu": cpu_model(),
        "cores": cores(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
    for mod in ("transformers", "tokenizers", "tiktoken", "sentencepiece", "numpy"):
        info[mod] = _version(mod)
    if torch.cuda.is_available():
        info["cuda"] = torch.cuda.get_device_name(0)
    return info


def machine_line(info: dict | None = None) -> str:
    m = info or machine()
    extra = ", ".join(f"{k} {m[k]}" for k in ("transformers", "tokenizers", "tiktoken", "sentencepiece"))
    return (f"{m['cpu']}, {m['cores']} cores (torch threads {m['torch_threads']}), torch {m['torch']}, "
            f"Python {m['python']}, {extra}" + (f", CUDA {m['cuda']}" if m.get("cuda") else ""))


# -- tables ------------------------------------------------------------------------------
def table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> str:
    """A Markdown table (pipes), columns padded so it also reads as plain text."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"

    out = [f"### {title}", ""] if title else []
    out.append(line(cells[0]))
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def fmt_ratio(x: float, goal: float | None = None) -> str:
    s = f"{x:.2f}x"
    if goal is not None:
        s += " ok" if x >= goal else f" (goal {goal:g}x, gap {goal - x:.2f}x)"
    return s


def fmt_pct(x: float, goal: float | None = None) -> str:
    s = f"{100 * x:.1f}%"
    if goal is not None:
        s += " ok" if x >= goal else f" (goal {100 * goal:.0f}%, gap {100 * (goal - x):.1f} pts)"
    return s


# -- corpus and tokenizer --------------------------------------------------------------------
def stdlib_texts(split: str | None = None) -> list[str]:
    """The stdlib corpus's documents (the prepare path's default source), in order."""
    from lmforge.data.sources import iter_documents

    return [d.text for d in iter_documents("stdlib", split)]


def stdlib_tokenizer(vocab_size: int = 8192, log: Callable[[str], None] = print):
    """The speedrun's tokenizer: byte-level BPE of `vocab_size` trained on the stdlib train
    split, cached under CACHE (re-trained when missing). Returns (Tokenizer, seconds spent
    training, 0 when it came from the cache)."""
    from lmforge.errors import LmforgeError
    from lmforge.tokenizer import Tokenizer, train_tokenizer

    folder = CACHE / f"tokenizer-stdlib-{vocab_size}"
    try:
        return Tokenizer.load(folder), 0.0
    except (LmforgeError, OSError):
        pass
    log(f"  (training a {vocab_size}-token stdlib tokenizer into {folder}, once)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tok = train_tokenizer(stdlib_texts("train"), vocab_size, folder, show_progress=False)
    return tok, time.perf_counter() - t0
