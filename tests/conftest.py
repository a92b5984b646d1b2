"""Shared fixtures: a tiny corpus, tokenizer, prepared data and config, made inside the tests
(hermetic: nothing is downloaded)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from lmforge.config import Config, load_config
from lmforge.tokenizer import Tokenizer, train_tokenizer

TINY_VOCAB = 384


def make_corpus(folder: Path, n_docs: int = 40, seed: int = 0) -> Path:
    """A folder of small Python-like text files (deterministic)."""
    rng = random.Random(seed)
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "else", "None",
             "print", "data", "result", "items", "key", "name", "True", "False", "x", "y", "tokens"]
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        lines = []
        for _ in range(rng.randint(3, 30)):
            indent = "    " * rng.randint(0, 2)
            lines.append(indent + " ".join(rng.choice(words) for _ in range(rng.randint(1, 8))) + rng.choice(["", ":", "()", " = 1", " # note"]))
        (folder / f"doc_{i:03d}.py").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def tiny_config(tmp: Path, corpus: Path | None = None, **overrides) -> Config:
    """A Config for a tiny model on the tiny corpus; `overrides` are 'section.key=value' strings."""
    sets = [
        f"data.source={str(corpus) if corpus else 'stdlib'}",
        f"tokenizer.dir={tmp / 'tok'}",
        f"data.dir={tmp / 'data'}",
        f"tokenizer.vocab_size={TINY_VOCAB}",
        "data.seq_len=64",
        "data.val_fraction=0.2",
        "model.dim=32",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.max_seq_len=128",
        "train.steps=4",
        "train.micro_batch_size=4",
        "train.lr=1e-2",
        "train.warmup_steps=1",
        "train.precision=fp32",
        "train.eval_tokens=256",
        "train.checkpoint_every=0",
        "train.log_every=1",
    ]
    sets += [f"{k}={v}" for k, v in overrides.items()]
    return load_config(None, sets)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory, tiny_corpus) -> Tokenizer:
    """A byte-level BPE with vocab 384 trained on the tiny corpus (session-scoped; do not modify)."""
    out = tmp_path_factory.mktemp("tok") / "tok"
    texts = [p.read_text() for p in sorted(tiny_corpus.glob("*.py"))]
    return train_tokenizer(texts, TINY_VOCAB, out, show_progress=False)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_corpus, tiny_tokenizer):
    """(config, tokenizer) with data prepared in config.data.dir (session-scoped; read only)."""
    from lmforge.stages import prepare_stage

    tmp = tmp_path_factory.mktemp("run")
    cfg = tiny_config(tmp, tiny_corpus, **{"tokenizer.dir": str(tiny_tokenizer.folder)})
    prepare_stage(cfg, progress=False)
    return cfg, tiny_tokenizer


@pytest.fixture
def init_ckpt(tiny_run, tmp_path):
    """A step_000003 checkpoint of the tiny model with seed-0 weights (what sft, dpo and rl start from)."""
    from lmforge.model import Transformer, resolve_model_config
    from lmforge.train.checkpoint import save_checkpoint

    cfg, tok = tiny_run
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    model.reset_parameters(seed=0)
    return save_checkpoint(tmp_path / "pre", 3, model, cfg, tok.folder)


# Tiny models are dominated by per-op overhead: one thread is several times faster than two
# threads contending, and keeps numbers deterministic.
torch.set_num_threads(1)

# inductor's on-disk caches one folder per CPU ISA, as lmforge's own compiles keep them: the suite
# under ATEN_CPU_CAPABILITY=avx2 right after a plain run read the plain run's kernels and failed
from lmforge.runtime import isolate_compile_cache  # noqa: E402

isolate_compile_cache()


@pytest.fixture(autouse=True)
def _seed():
    """Each test starts seeded and with no signal recorded by an earlier one (the tests send this
    process SIGINT/SIGTERM; a test's verdict must not hang on which ran before it in a worker)."""
    from lmforge.errors import clear_stop_requests

    clear_stop_requests()
    torch.manual_seed(0)
    random.seed(0)
