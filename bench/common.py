"""Shared helpers for the benchmarks in bench/: timing statistics, interleaved runs,
peak-RSS probes, the machine description, tables, a cached stdlib tokenizer, the smoke
mode's tiny corpus and tokenizer, the transformers twin of an lmforge model, and child
processes for runtimes that may crash.

Every benchmark runs lmforge and its reference in one process, interleaved round by
round (so a noisy neighbour slows both alike), and reports medians over the measured
repeats after warm-up, with the min-max spread. A third-party runtime that can die with
a signal (llama.cpp) runs in a `Child` process instead, so that its crash becomes a row
("crashed: SIGILL") rather than the end of `make bench`.

Every benchmark takes `--smoke` (`smoke_flag`): a run of seconds at tiny sizes that proves
it still works (tests/test_bench_smoke.py runs each one); its figures mean nothing, it
writes nothing outside a temporary folder, and run_all.py never records it.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
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
                after: Callable[[str], None] | None = None,
                failed: dict[str, str] | None = None) -> dict[str, Stats]:
    """Run every fn `warmup` times untimed, then `repeat` timed rounds, interleaved.

    Round r runs the fns in order, reversed on odd rounds, so neither side always runs
    right after the other. `before(name)` / `after(name)` wrap each timed call (not
    timed themselves; used for RSS probes). Returns seconds per call, per name.

    With `failed` (a dict), a fn that raises `ChildFailed` (its child process crashed, exited
    or hung) is dropped from the rounds left and `failed[name]` gets its status
    ("crashed: SIGSEGV"); the others go on and the result leaves that name out.
    """
    names = list(fns)

    def call(n: str) -> bool:
        try:
            fns[n]()
            return True
        except ChildFailed as exc:
            if failed is None:
                raise
            failed[n] = exc.status
            names.remove(n)
            return False

    for _ in range(warmup):
        for n in list(names):
            call(n)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeat):
        for n in (list(names) if r % 2 == 0 else names[::-1]):
            if before:
                before(n)
            t0 = time.perf_counter()
            ok = call(n)
            if ok:
                times[n].append(time.perf_counter() - t0)
            if after:
                after(n)
    return {n: Stats(times[n]) for n in names if times[n]}


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
    """Hand freed heap pages back to the kernel (`lmforge.model.memory.release_free_memory`: glibc's
    `malloc_trim`), so that RSS measures live memory rather than what the allocator keeps cached."""
    from lmforge.model.memory import release_free_memory as release

    release()


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


# -- smoke mode ----------------------------------------------------------------------------------
SMOKE_HELP = ("a run of seconds at tiny sizes that proves the benchmark still works (tests/test_bench_smoke.py); "
              "its figures mean nothing and are never recorded")


def smoke_flag(ap) -> None:
    """Add `--smoke` (every benchmark has it; run_all.py --smoke passes it on) to an ArgumentParser."""
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def smoke_texts(n_docs: int = 60, max_chars: int = 4000) -> list[str]:
    """The smoke runs' corpus: the first `n_docs` documents of the stdlib train split, each cut
    to `max_chars` characters (~0.2 MB in all)."""
    from lmforge.data.sources import iter_documents

    out = []
    for d in iter_documents("stdlib", "train"):
        out.append(d.text[:max_chars])
        if len(out) == n_docs:
            break
    return out


def smoke_corpus(folder: Path, n_docs: int = 60, max_chars: int = 4000) -> Path:
    """`smoke_texts` written as a folder of .py files (a `data.source` for prepare); returns `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(smoke_texts(n_docs, max_chars)):
        (folder / f"doc_{i:03d}.py").write_text(text, encoding="utf-8")
    return folder


def smoke_tokenizer(folder: Path, vocab_size: int = 512):
    """A byte-level BPE of `vocab_size` trained on `smoke_texts` into `folder` (under a second)."""
    from lmforge.tokenizer import train_tokenizer

    return train_tokenizer(smoke_texts(), vocab_size, folder, show_progress=False)


def bench_tokenizer(smoke: bool, tmp: Path, vocab_size: int = 8192, log: Callable[[str], None] = print):
    """The tokenizer a benchmark decodes or trains with: the cached stdlib one of `vocab_size`
    (`stdlib_tokenizer`), or in a smoke run a 512-token one trained into `tmp` (the cache is
    left alone). Returns the Tokenizer."""
    if smoke:
        return smoke_tokenizer(tmp / "smoke-tokenizer")
    return stdlib_tokenizer(vocab_size, log)[0]


#: Model shapes the decode benchmarks take (`--shape`), in lmforge's [model] names with the vocabulary:
#: the speedrun's (lmforge's defaults: QK-norm, so a Qwen3 in transformers and llama.cpp), and the
#: SmolLM2-135M shape a user brings (a Llama: 576 x 30 layers, 9 / 3 heads, MLP 1,536, tied head,
#: RoPE base 100,000; bench_finetune.SMOLLM2_135M in transformers' names).
SHAPES = {
    "speedrun": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192),
    "smollm2-135m": dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536, qk_norm=False,
                         tie_embeddings=True, rope_theta=100_000.0, norm_eps=1e-5, vocab_size=49_152),
}


#: Shapes the decode benchmarks take as a user brings them: a transformers folder (bench_finetune.USER_SHAPES,
#: random weights, built by transformers itself) imported with `lmforge import-hf` (`imported_model`).
#: Gemma 3 270M: 640 x 18 layers, 4 / 1 heads of 256, five sliding layers to one full, GeGLU, a tied
#: 262,144-row head (671 MB in fp32, ~60% of the bytes a token reads).
IMPORTED_SHAPES = ("gemma3-270m",)


def shape_flag(ap) -> None:
    """--shape: one of SHAPES or IMPORTED_SHAPES (default "speedrun")."""
    ap.add_argument("--shape", choices=sorted([*SHAPES, *IMPORTED_SHAPES]), default="speedrun",
                    help="the model's shape: the speedrun's, a user's SmolLM2-135M (built in lmforge), or a user's "
                         "Gemma 3 270M (a transformers folder imported); random weights in each")


def imported_model(work: Path, smoke: bool, shape: str):
    """A user's model of `shape` (IMPORTED_SHAPES) as the user has it: transformers saves a folder of
    random weights (`bench_finetune.build_user_folder`: its tokenizer and chat template too) into
    work/user and `lmforge import-hf` turns it into work/imported. Returns (the checkpoint folder,
    the lmforge model in eval mode as `lmforge generate` loads it, its Tokenizer, the transformers
    folder); `smoke`: the shape's tiny twin."""
    import bench_finetune

    from lmforge.loading import load_checkpoint

    bench_finetune.import_user_folder(work, smoke, shape)
    cp = load_checkpoint(work / "imported")
    return cp.path, cp.model, cp.tokenizer, work / "user"


# -- the transformers twin of an lmforge model ------------------------------------------------------
def synthetic_contract(vocab_size: int):
    """A contract for random weights without a tokenizer: pad 0, bos 1, eos 2, im_start 3, im_end 4."""
    from lmforge.contract import Contract, padded_vocab_size, token_dtype_for

    return Contract("", vocab_size, padded_vocab_size(vocab_size),
                    {"pad": 0, "bos": 1, "eos": 2, "im_start": 3, "im_end": 4}, "", token_dtype_for(vocab_size))


def hf_twin(model, contract, **config_overrides):
    """The `transformers` model `lmforge export --format hf` would produce from `model`, built in
    memory: the exporter's own `hf_config` (LlamaForCausalLM, or Qwen3ForCausalLM for a QK-norm
    model) and `to_hf_state`, loaded strictly. float32, eval mode. `config_overrides` are
    transformers config fields (use_cache, ...).

    Raises:
        LmforgeError: transformers is not installed.
    """
    from lmforge.export import hf_config, require_transformers, to_hf_state
    from lmforge.model.io import model_state

    transformers = require_transformers()
    cfg = {k: v for k, v in hf_config(model.config, contract).items() if k != "torch_dtype"}
    cfg.update(config_overrides)
    arch = cfg["architectures"][0]
    hf_cfg = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    twin = getattr(transformers, arch)(hf_cfg)
    result = twin.load_state_dict(to_hf_state(model_state(model), contract.vocab_size, model.config.tie_embeddings),
                                  strict=False)
    # a tied head is the embedding: transformers lists it as a key of its own, which the export leaves out
    tied = {"lm_head.weight"} if model.config.tie_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise RuntimeError(f"the transformers twin's weights differ: missing {result.missing_keys}, "
                           f"unexpected {result.unexpected_keys}")
    if tied:
        twin.tie_weights()
        if twin.lm_head.weight.data_ptr() != twin.model.embed_tokens.weight.data_ptr():
            raise RuntimeError("the transformers twin's head is not tied to its embedding")
    return twin.float().eval()


# -- child processes ------------------------------------------------------------------------------
class ChildFailed(RuntimeError):
    """A child process ended, or stopped answering, before it replied. `status` is what a table
    shows ("crashed: SIGILL", "exit 1", "timed out after 600 s"); `detail` is the end of its stderr."""

    def __init__(self, status: str, detail: str = ""):
        super().__init__(status + (f"\n{detail}" if detail else ""))
        self.status, self.detail = status, detail


def exit_status(returncode: int) -> str:
    """How a process ended, as a table cell: "crashed: SIGSEGV" (killed by a signal), "exit 1"."""
    if returncode < 0:
        try:
            return f"crashed: {signal.Signals(-returncode).name}"
        except ValueError:
            return f"crashed: signal {-returncode}"
    return f"exit {returncode}"


class Child:
    """A Python child process that answers JSON requests, one line each way, so that a runtime
    it hosts can crash (SIGSEGV, SIGILL, abort) without taking the benchmark with it.

    `argv` starts the child, which calls `serve_requests(setup)`.
    `request(obj)` sends `obj` and returns the handler's answer. Whenever the child ends or
    does not answer within `timeout` seconds, `request` raises `ChildFailed` (the child is
    gone by then; later calls raise the same). Its stderr is kept in a temporary file and the
    last lines go into the error. Use as a context manager, or call `close()`.
    """

    def __init__(self, argv: Sequence[str], timeout: float = 600.0, env: dict | None = None):
        self.timeout = timeout
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     env=env)
        self._buf = b""
        self.failed: ChildFailed | None = None

    def _fail(self, status: str | None = None) -> ChildFailed:
        if self.proc.poll() is None:
            self.proc.kill()
        rc = self.proc.wait()
        self._stderr.seek(0)
        tail = "\n".join(self._stderr.read().decode("utf-8", "replace").strip().splitlines()[-20:])
        self.failed = ChildFailed(status or exit_status(rc), tail)
        return self.failed

    def request(self, obj) -> object:
        """Send one JSON request, return the JSON answer. Raises ChildFailed."""
        if self.failed:
            raise self.failed
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:  # BrokenPipeError: it is gone already
            raise self._fail() from None
        deadline = time.monotonic() + self.timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:  # bounded by the deadline
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"timed out after {self.timeout:g} s")
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # end of file: the child ended without answering
                raise self._fail()
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def close(self) -> None:
        """End the child (stdin closed: its loop returns; killed after 10 s)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self._stderr.close()

    def __enter__(self) -> "Child":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve_requests(setup: Callable[[], Callable[[object], object]]) -> None:
    """The child's side of `Child`: `setup()` (load the runtime) returns a handler; answer
    `handler(request)` for each JSON line on stdin until stdin closes. The answers go to the
    original stdout; stdout itself is sent to stderr before `setup` runs, so nothing the
    hosted runtime prints, while loading or later, can corrupt them. An exception ends the
    child (exit 1, its traceback on stderr)."""
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    handler = setup()
    for line in sys.stdin:  # bounded: ends when the parent closes stdin
        if line.strip():
            answers.write(json.dumps(handler(json.loads(line))) + "\n")
            answers.flush()


def run_streaming(argv: Sequence[str], timeout: float, echo=None, env: dict | None = None) -> tuple[str, str | None]:
    """Run `argv` with its stdout copied line by line to `echo` (default sys.stdout) as it comes
    (stderr passes through). Returns (its stdout, None when it exited 0, else its status:
    "crashed: SIGSEGV", "exit 1", "timed out after 600 s")."""
    echo = echo or sys.stdout
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, text=True, encoding="utf-8", errors="replace",
                            env=env)
    lines: list[str] = []

    def pump() -> None:
        for line in proc.stdout:  # bounded: ends at the child's end of file
            lines.append(line)
            echo.write(line)
            echo.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    status = None
    try:
        rc = proc.wait(timeout=timeout)
        if rc != 0:
            status = exit_status(rc)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        status = f"timed out after {timeout:g} s"
    reader.join(timeout=10)
    return "".join(lines), status
