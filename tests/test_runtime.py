"""lmforge.runtime: the device and the precision are decided once per command and passed down.
Evaluation, generation and the trainer run under the `Runtime` they are given, whatever
autocast the caller has on (a forward hook reads the autocast state inside the model)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lmforge.config import SamplingConfig
from lmforge.data.shards import Shard
from lmforge.evaluate import evaluate_shard
from lmforge.generate import generate
from lmforge.model import Transformer, resolve_model_config
from lmforge.runtime import CPU_FP32, Runtime, compute_dtype, decode_runtime, training_runtime

CPU_BF16 = Runtime(torch.device("cpu"), torch.bfloat16)


def autocast_probe(module: torch.nn.Module) -> list[tuple[bool, torch.dtype]]:
    """Records (autocast on for the CPU?, its dtype) at every call of `module`."""
    seen = []
    module.register_forward_pre_hook(
        lambda m, args: seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))))
    return seen


@pytest.fixture
def model(tiny_run):
    cfg, tok = tiny_run
    m = Transformer(resolve_model_config(cfg.model, tok.contract))
    m.reset_parameters(seed=0)
    return m.eval()


def test_compute_dtype_follows_autocast():
    assert compute_dtype(torch.device("cpu"), torch.float32) == torch.float32
    with CPU_BF16.autocast():
        assert compute_dtype(torch.device("cpu"), torch.float32) == torch.bfloat16
        assert compute_dtype("cpu", torch.float64) == torch.bfloat16
        with CPU_FP32.autocast():  # fp32 switches autocast off, whatever the caller had on
            assert compute_dtype("cpu", torch.float32) == torch.float32


def test_the_runtimes_are_decided_by_their_policy():
    assert training_runtime("fp32", "cpu") == CPU_FP32
    assert training_runtime("bf16", "cpu") == CPU_BF16
    assert decode_runtime("cpu") == CPU_FP32  # decoding on a CPU is fp32 (see decode_runtime)


@pytest.mark.parametrize("runtime", [CPU_FP32, CPU_BF16], ids=["fp32", "bf16"])
def test_evaluation_runs_under_the_runtime_it_is_given(tiny_run, model, runtime):
    cfg, tok = tiny_run
    shard = Shard.open(cfg.data.dir, "val", tok.contract)
    seen = autocast_probe(model.layers[0])
    outer = CPU_BF16 if runtime is CPU_FP32 else CPU_FP32  # the caller's context is the other one
    with outer.autocast():
        res = evaluate_shard(model, shard, seq_len=32, batch_size=4, runtime=runtime)
    assert seen and res["tokens"] > 0
    assert {on for on, _ in seen} == {runtime.dtype is not None}
    if runtime.dtype is not None:
        assert {dtype for _, dtype in seen} == {runtime.dtype}


@pytest.mark.parametrize("runtime", [CPU_FP32, CPU_BF16], ids=["fp32", "bf16"])
def test_generation_runs_under_the_runtime_it_is_given(tiny_run, model, runtime):
    _, tok = tiny_run
    seen = autocast_probe(model.tok_embeddings)  # called by the prefill and by every decode step
    outer = CPU_BF16 if runtime is CPU_FP32 else CPU_FP32
    with outer.autocast():
        out = generate(model, [[tok.bos_id, 5, 6]], [], SamplingConfig(max_new_tokens=4, greedy=True), tok.pad_id,
                       runtime=runtime)
    assert len(out[0]) == 4 and len(seen) == 4  # prefill + 3 decode steps
    assert {on for on, _ in seen} == {runtime.dtype is not None}
    if runtime.dtype is not None:
        assert model.decode_weights(torch.bfloat16).dtype == torch.bfloat16


def test_generation_without_a_runtime_takes_the_decoding_policy(tiny_run, model):
    _, tok = tiny_run
    seen = autocast_probe(model.tok_embeddings)
    with CPU_BF16.autocast():
        generate(model, [[tok.bos_id, 5]], [], SamplingConfig(max_new_tokens=2, greedy=True), tok.pad_id)
    assert {on for on, _ in seen} == {decode_runtime("cpu").dtype is not None}


@pytest.mark.parametrize("runtime", [CPU_FP32, CPU_BF16], ids=["fp32", "bf16"])
def test_trainer_steps_under_the_runtime_it_is_given(tiny_run, tmp_path, runtime):
    from lmforge.data.packing import shard_stream
    from lmforge.train.trainer import Trainer

    cfg, tok = tiny_run
    cfg = replace(cfg, train=replace(cfg.train, optimizer="muon", precision="auto"))
    m = Transformer(resolve_model_config(cfg.model, tok.contract))
    stream = shard_stream(Shard.open(cfg.data.dir, "train", tok.contract), cfg.data.seq_len,
                          cfg.train.micro_batch_size, cfg.train.seed)
    trainer = Trainer(cfg, tmp_path / "run", Path(cfg.tokenizer.dir), m, stream, progress=False,
                      log=lambda msg: None, runtime=runtime)
    seen = autocast_probe(m.layers[0])
    trainer.train_step()
    assert seen and {on for on, _ in seen} == {runtime.dtype is not None}
    ns = {g["ns_dtype"] for g in trainer.optimizer.param_groups if g["kind"] == "muon"}
    assert ns == {"float32" if runtime.dtype is None else "bfloat16"}  # Muon follows the same runtime


def test_the_compute_dtype_is_read_in_one_place():
    """Only runtime.py asks torch for the autocast dtype; the model, the loss, the decode path and
    generation call `compute_dtype` (the serve engine goes through the model)."""
    src = Path(__file__).resolve().parents[1] / "src" / "lmforge"
    asking = sorted(str(p.relative_to(src)) for p in src.rglob("*.py")
                    if "get_autocast_dtype" in p.read_text(encoding="utf-8"))
    assert asking == ["runtime.py"], asking


def test_inductor_caches_are_kept_one_folder_per_cpu_isa(monkeypatch, tmp_path):
    """Inductor does not key its caches by the ISA its kernels are built for (kernels built for
    AVX512 read under ATEN_CPU_CAPABILITY=avx2 gave wrong numbers): unless the user chose a
    folder, each ISA gets its own; the user's own folder is kept."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from lmforge.runtime import isolate_compile_cache

    folders = {}
    for isa in ("AVX512", "AVX2"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda isa=isa: isa)
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        folders[isa] = isolate_compile_cache()
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # torch writes its default back
        assert isolate_compile_cache() == folders[isa]
    assert folders["AVX512"] != folders["AVX2"] and folders["AVX2"].endswith("lmforge-avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert isolate_compile_cache() == str(tmp_path / "mine") == os.environ["TORCHINDUCTOR_CACHE_DIR"]
