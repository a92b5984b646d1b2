"""Parallel degrees and shapes are validated before any work, with messages that say what
to change (P7): world size = data-parallel x context-parallel degree; seq_len divisible by
2 x context-parallel degree; the global batch a multiple of micro-batch x data-parallel
degree (and equal to micro-batch x accumulation x data-parallel degree); n_heads divisible
by n_kv_heads; dim divisible by n_heads; 1 <= seq_len <= max_seq_len."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lmforge.cli import main
from lmforge.config import load_config, validate_parallel, world_size_from_env
from lmforge.errors import ConfigError
from lmforge.train.distributed import init_distributed


def cfg_with(*sets: str):
    base = ["model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=128",
            "data.seq_len=64", "train.micro_batch_size=4"]
    return load_config(None, base + list(sets))


def test_world_size_must_be_a_multiple_of_the_context_parallel_degree():
    cfg = cfg_with("train.context_parallel=2")
    with pytest.raises(ConfigError) as exc:
        validate_parallel(cfg, 3)
    msg = str(exc.value)
    assert "world size 3 (WORLD_SIZE, the ranks torchrun starts) is not divisible by train.context_parallel = 2" in msg
    assert "world size = data-parallel degree x context-parallel degree" in msg
    assert "--nproc-per-node 2" in msg and "set train.context_parallel to one of [1, 3]" in msg
    validate_parallel(cfg, 4)  # 2 data-parallel x 2 context-parallel
    validate_parallel(cfg, 2)


def test_seq_len_must_split_into_two_chunks_per_context_parallel_rank():
    with pytest.raises(ConfigError) as exc:
        cfg_with("train.context_parallel=4", "data.seq_len=60")
    msg = str(exc.value)
    assert "data.seq_len = 60 is not divisible by 2 x train.context_parallel = 8" in msg
    assert "Set data.seq_len to a multiple of 8 (for example 56)" in msg
    with pytest.raises(ConfigError, match=r"data.seq_len = 3 is not divisible by 2 x train.context_parallel = 4.*"
                                          r"for example 4\)"):
        cfg_with("train.context_parallel=2", "data.seq_len=3")
    cfg_with("train.context_parallel=4", "data.seq_len=64")  # fine
    cfg_with("data.seq_len=63")  # no context parallelism: any length


def test_global_batch_must_be_a_multiple_of_micro_batch_times_data_parallel_degree():
    cfg = cfg_with("train.global_batch_size=12")  # micro-batch 4
    validate_parallel(replace_accum(cfg, 3), 1)  # 4 x 3 x 1
    with pytest.raises(ConfigError) as exc:
        validate_parallel(cfg, 2)  # unit 4 x 2 = 8
    msg = str(exc.value)
    assert ("train.global_batch_size = 12 is not divisible by train.micro_batch_size x data-parallel degree = "
            "4 x 2 = 8 (world size 2 / train.context_parallel 1)") in msg
    assert "multiple of 8 (for example 8)" in msg
    # the data-parallel degree is world size / context-parallel degree
    cfg = cfg_with("train.global_batch_size=8", "train.context_parallel=2")
    validate_parallel(replace_accum(cfg, 1), 4)  # dp = 2: 4 x 1 x 2
    with pytest.raises(ConfigError, match=r"data-parallel degree = 4 x 4 = 16 \(world size 8 / train.context_parallel 2\)"):
        validate_parallel(cfg, 8)


def test_global_batch_must_match_the_accumulation():
    cfg = cfg_with("train.global_batch_size=32", "train.grad_accum_steps=2")
    validate_parallel(cfg, 4)  # 4 x 2 x 4
    with pytest.raises(ConfigError) as exc:
        validate_parallel(cfg, 2)
    msg = str(exc.value)
    assert ("train.global_batch_size = 32, but train.micro_batch_size x train.grad_accum_steps x data-parallel "
            "degree = 4 x 2 x 2 = 16. Set train.grad_accum_steps = 4 to keep the global batch on 2 rank(s)") in msg
    validate_parallel(cfg_with("train.grad_accum_steps=3"), 7)  # 0 = derived: anything goes


def replace_accum(cfg, accum):
    from dataclasses import replace

    return replace(cfg, train=replace(cfg.train, grad_accum_steps=accum))


@pytest.mark.parametrize("sets, expected", [
    (["model.n_kv_heads=3"], "model.n_heads = 4 is not divisible by model.n_kv_heads = 3"),
    (["model.dim=30", "model.n_heads=4", "model.n_kv_heads=1"], "model.dim = 30 is not divisible by model.n_heads = 4"),
    (["data.seq_len=0"], "data.seq_len = 0: expected 1 <= value"),
    (["data.seq_len=129"], "data.seq_len = 129 exceeds model.max_seq_len = 128. Lower data.seq_len or raise "
                           "model.max_seq_len"),
    (["train.context_parallel=0"], "train.context_parallel = 0: expected 1 <= value"),
    (["train.global_batch_size=-8"], "train.global_batch_size = -8: expected 0 <= value"),
])
def test_shape_errors_name_the_keys(sets, expected):
    with pytest.raises(ConfigError) as exc:
        cfg_with(*sets)
    assert expected in str(exc.value)


def test_head_errors_suggest_a_divisor():
    with pytest.raises(ConfigError, match=r"Choose n_kv_heads dividing n_heads \(for example 2\)"):
        cfg_with("model.n_kv_heads=3", "model.n_heads=8", "model.dim=64")
    with pytest.raises(ConfigError, match=r"Choose n_heads dividing dim \(for example 6\)"):
        cfg_with("model.dim=30", "model.n_heads=7", "model.n_kv_heads=1")


def test_world_size_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert world_size_from_env() == 1
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert world_size_from_env() == 6
    for bad in ("two", "0"):
        monkeypatch.setenv("WORLD_SIZE", bad)
        with pytest.raises(ConfigError, match=f"environment variable WORLD_SIZE = '{bad}': expected a positive integer"):
            world_size_from_env()


def test_start_up_validates_before_any_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # a process group could not even start
    with pytest.raises(ConfigError, match="world size 3 .* is not divisible by train.context_parallel = 2"):
        init_distributed(cfg_with("train.context_parallel=2"))
    with pytest.raises(ConfigError, match="train.global_batch_size = 8 is not divisible by .* = 4 x 3 = 12"):
        init_distributed(cfg_with("train.global_batch_size=8"))
    assert not dist.is_initialized()


def test_context_parallel_is_validated_then_refused(monkeypatch):
    """A valid context-parallel configuration passes validation, then stops: not implemented yet."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    cfg = cfg_with("train.context_parallel=2", "train.global_batch_size=8")  # dp 2 x micro-batch 4
    validate_parallel(cfg, 4)
    with pytest.raises(ConfigError) as exc:
        init_distributed(cfg)
    msg = str(exc.value)
    assert "train.context_parallel = 2: the configuration is valid, but context parallelism is not implemented yet" in msg
    assert "Set train.context_parallel = 1" in msg
    assert not dist.is_initialized()


def test_cli_stops_with_the_message_before_any_work(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    out = tmp_path / "run"
    code = main(["pretrain", "--out", str(out), "--set", "train.micro_batch_size=4",
                 "--set", "train.global_batch_size=4", "--set", f"tokenizer.dir={tmp_path / 'missing'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert "error: train.global_batch_size = 4 is not divisible by train.micro_batch_size x data-parallel " \
           "degree = 4 x 2 = 8" in err
    assert not out.exists()  # nothing was written, not even the run folder


def test_the_parallel_degrees_have_one_check_run_once_at_start_up(monkeypatch):
    """`config.check_parallel` (validate_parallel, then what is not implemented) is the one
    check; `init_distributed` is its only caller (the trainer and `validate` do not repeat it)."""
    import ast
    from pathlib import Path

    from lmforge.config import check_parallel

    cfg = cfg_with("train.context_parallel=2", "train.global_batch_size=8")
    validate_parallel(cfg, 4)  # a valid configuration ...
    with pytest.raises(ConfigError, match="train.context_parallel = 2: the configuration is valid, but context "
                                          "parallelism is not implemented yet"):
        check_parallel(cfg, 4)  # ... that lmforge does not run yet
    with pytest.raises(ConfigError, match="world size 3 .* is not divisible by train.context_parallel = 2"):
        check_parallel(cfg, 3)
    assert check_parallel(cfg_with(), 1) is not None
    src = Path(__file__).resolve().parents[1] / "src" / "lmforge"
    callers = {}
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                    "check_parallel", "validate_parallel"):
                callers.setdefault(str(path.relative_to(src)), []).append(node.func.id if hasattr(node.func, "id")
                                                                          else node.func.attr)
    assert callers == {"train/distributed.py": ["check_parallel"], "config/schema.py": ["validate_parallel"]}, callers
