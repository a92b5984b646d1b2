"""Where and in what precision a stage runs: decided here, once per stage.

`Runtime` carries the device and the autocast dtype (None = fp32). Training, evaluation
and scoring take `train.precision` ("auto" = bf16 autocast where the hardware has bf16
units, else fp32; "bf16"; "fp32"); decoding (`generate`, `chat`, scoring bodies, the
server) has one policy of its own, `decode_runtime`, chosen by measurement (see its
docstring). CUDA is used where present, the CPU otherwise.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmforge.errors import ConfigError


def default_device(index: int | None = None) -> torch.device:
    """CUDA when there is a CUDA device (`index`: which one, e.g. torchrun's LOCAL_RANK), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda") if index is None else torch.device("cuda", index)
    return torch.device("cpu")


def bf16_supported(device: torch.device) -> bool:
    """True where bf16 matmuls run natively (CUDA with bf16, a CPU with AVX512-BF16/AMX):
    elsewhere autocast emulates bf16, far slower than fp32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `precision` ("auto" | "bf16" | "fp32") on `device`, or None (fp32)."""
    if precision == "fp32":
        return None
    if precision == "bf16" or bf16_supported(device):
        return torch.bfloat16
    return None


def autocast(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast for `dtype`, or a no-op context for fp32 (None)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def compute_dtype(device: torch.device | str, default: torch.dtype) -> torch.dtype:
    """The dtype matmuls run in on `device` at this point: the autocast dtype while autocast is
    on for the device's type (what `Runtime.autocast` switched on), else `default` (the
    parameters' dtype). The model's rotary tables, masks, KV cache and decode weights follow it."""
    kind = device.type if isinstance(device, torch.device) else str(device)
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else default


@dataclass(frozen=True)
class Runtime:
    """Where and in what precision a stage's model runs: decided once per command (by
    `training_runtime` or `decode_runtime`) and passed down to the trainer, evaluation and
    generation, which enter `autocast()` around the model's calls and decide nothing."""

    device: torch.device
    dtype: torch.dtype | None
    """autocast dtype (torch.bfloat16), or None for fp32."""

    def autocast(self):
        """Autocast to `dtype`, or (fp32) autocast switched off, whatever the caller had on."""
        if self.dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return autocast(self.device, self.dtype)

    @property
    def label(self) -> str:
        return f"{self.device}, {'bf16 autocast' if self.dtype else 'fp32'}"

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse to run `model` here when it would compute in float16 and its norms carry an
        offset (`check_float16_compute`): called by the trainer, evaluation, generation and the
        server where a model meets its runtime.

        Raises:
            ConfigError: see `check_float16_compute`.
        """
        config = getattr(model, "config", None)
        if not getattr(config, "norm_offset", 0.0):
            return
        if self.dtype == torch.float16:
            check_float16_compute(config, "the runtime's autocast dtype (train.precision)")
        half = next((n for n, p in model.named_parameters() if p.dtype == torch.float16), None)
        if half is not None:
            check_float16_compute(config, f"the model's weights ({half} is float16; no autocast widens the "
                                          f"residual stream)")


#: fp32 on the CPU: the default of library functions that take a Runtime (commands decide theirs).
CPU_FP32 = Runtime(torch.device("cpu"), None)


def check_float16_compute(model, what: str) -> None:
    """Refuse float16 compute for a model whose RMSNorm multiplies by (norm_offset + w)
    (`model.norm_offset` != 0: Gemma 2 and 3). Such models overflow float16 (|x| <= 65504) in their
    residual stream, their sandwich norms' large weights and the GeGLU gate: users see NaN or empty
    output and loss 0 (transformers#36822, LlamaFactory#7755; vLLM refuses
    float16 for Gemma 3). Decided by the mechanism, never the family's name. Only compute is
    refused: float16 *weights* in an export (`lmforge export --dtype float16`) stay allowed.

    lmforge itself never chooses float16 compute (`train.precision` is auto, bf16 or fp32, and
    `decode_runtime` is fp32 or bf16); this guards a Runtime or a model built by hand.

    Args:
        model: a ModelConfig (or anything with `norm_offset`).
        what: where the float16 comes from, for the message.
    Raises:
        ConfigError: naming model.norm_offset, the float16 seen, bf16 / fp32 expected, the fix.
    """
    offset = getattr(model, "norm_offset", 0.0)
    if not offset:
        return
    raise ConfigError(
        f"model.norm_offset = {offset:g} ((offset + w) norms, as Gemma 2/3 have) cannot compute in float16, "
        f"but {what} is float16: such models overflow float16's range (|x| <= 65504) and give NaN or empty "
        f"output. Expected bfloat16 or float32 compute: set train.precision = \"bf16\" or \"fp32\" (a Runtime "
        f"with dtype torch.bfloat16 or None) and keep the weights float32 or bfloat16 (model.float()). "
        f"Exporting float16 weights (--dtype float16) stays allowed.")


def training_runtime(precision: str, device: torch.device | str | None = None) -> Runtime:
    """The runtime of training, evaluation and loss scoring: `train.precision` on `device`
    (default: CUDA when present)."""
    device = torch.device(device) if device is not None else default_device()
    return Runtime(device, resolve_precision(precision, device))


def decode_runtime(device: torch.device | str | None = None) -> Runtime:
    """The one decoding policy (generate, chat, the speedrun's body scoring, serve).

    On CUDA: bf16 autocast where supported. On a CPU: fp32. Measured with
    `bench/bench_decode_policy.py` on the 2-core AVX512-BF16 CPU (speedrun-shaped model,
    greedy, 64 new tokens, 1 thread; 2026-11-23): fp32 1.33-1.81x faster than bf16 autocast at
    batch 1 (autocast re-casts every weight at every T = 1 step, a latency-bound step), 0.88-0.93x
    at batch 8; bf16 changed about half the greedy ids (34/64, 341/512). fp32 is also the
    precision the parity tests with transformers and llama.cpp compare against, so `generate`,
    `chat`, the speedrun's scoring and the server all decode in fp32 on a CPU.
    """
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        return Runtime(device, resolve_precision("auto", device))
    return Runtime(device, None)


def compiler_available(device: torch.device, log: Callable[[str], None] | None = None,
                       setting: str = "train.compile") -> bool:
    """`setting` (train.compile, generate.compile) on `device`: on CPU, torch.compile's inductor
    builds C++ kernels and needs a C++ compiler (`$CXX`, g++, c++ or clang++ on PATH); without one
    the work runs eagerly and says so in one line, instead of failing deep inside torch."""
    isolate_compile_cache()
    if device.type != "cpu":
        return True
    found = [c for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c and shutil.which(c)]
    if not found and log is not None:
        log(f"{setting} = true: no C++ compiler on PATH ($CXX, g++, c++, clang++), which torch.compile needs "
            f"on a CPU; running without compiling (install g++ to compile, or set {setting} = false)")
    return bool(found)


@contextlib.contextmanager
def deterministic_kernels(enabled: bool = True):
    """Within it, `torch.use_deterministic_algorithms(True)` (warn-only) with uninitialised memory
    left unfilled; the previous settings come back on exit. A no-op when `enabled` is False.

    The trainer runs a compiled CPU step's forward and backward under it (issue 53). Inductor lowers
    the embedding's backward (an `index_put` that accumulates) to a C++ loop that OpenMP splits over
    the tokens, each thread `atomic_add`-ing its rows into the gradient: two threads adding to one
    token's row land in the order they happen to run, so the last bits of the embedding gradient
    changed from run to run whenever torch had more than one thread (torch 2.13; a straight compiled
    run and the same run stopped at step 1 and resumed differed by 1e-9 at step 3 and 1e-4 at step 6,
    warm or cold inductor cache). Under this mode inductor calls ATen's serial `index_put_` there
    instead (`torch._inductor.lowering.index_put_impl_`; scatters likewise). The mode is part of
    inductor's cache key and of dynamo's guards, so graphs compiled outside it are not reused.
    Filling uninitialised memory (NaN) is only a debugging aid and costs a pass over every buffer:
    it stays off."""
    if not enabled:
        yield
        return
    import torch.utils.deterministic  # noqa: F401 (the module's property: fill_uninitialized_memory)

    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def isolate_compile_cache() -> str:
    """Keep inductor's on-disk caches one folder per CPU vector ISA; returns the folder.

    Inductor's caches (`TORCHINDUCTOR_CACHE_DIR`, default /tmp/torchinductor_USER) are not keyed by
    the ISA its C++ kernels are built for: kernels written under one (`ATEN_CPU_CAPABILITY=avx2`,
    or another machine sharing the folder) and read under another computed wrong numbers (a
    compiled cross-entropy off by 11.6) or corrupted the heap (torch 2.13, 2026-11-27, AMD EPYC;
    with a folder each, both ISAs give eager's numbers). Unless the user chose a folder of their
    own, lmforge uses `<default>/lmforge-<isa>` (`torch.backends.cpu.get_cpu_capability()`).
    Call it before the first compile of the process (`compiler_available` does)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.abspath(default_cache_dir())
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == default:  # unset, or torch's own default (it writes it back)
        isa = re.sub(r"[^a-z0-9_]", "_", torch.backends.cpu.get_cpu_capability().lower())
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(default, f"lmforge-{isa}")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


__all__ = ["CPU_FP32", "Runtime", "autocast", "isolate_compile_cache", "bf16_supported", "check_float16_compute",
           "compiler_available", "compute_dtype", "decode_runtime", "deterministic_kernels",
           "default_device",
           "resolve_precision", "seed_everything", "training_runtime"]


def seed_everything(seed: int) -> None:
    """Seed every generator a run draws from (Python's, numpy's, torch's on every device), once,
    at the start of a command; `train.checkpoint.rng_state` snapshots them all."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
