"""Tiny checkpoints for the GGUF tests (tests/test_gguf.py, tests/interop/): made inside the
tests, nothing downloaded."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import tiny_config
from lmforge.model import Transformer, resolve_model_config
from lmforge.train.checkpoint import save_checkpoint


def make_checkpoint(tmp: Path, corpus: Path, tok, seed: int = 0, **overrides) -> Path:
    """A step_000000 checkpoint of a tiny random model (dim 64, GQA 4/2 heads, head_dim 16,
    rope_theta and norm_eps off their defaults so a mapping mistake shows; norm weights not 1;
    the output scaled so greedy decoding is far from ties)."""
    sets = {"tokenizer.dir": str(tok.folder), "model.dim": 64, "model.n_heads": 4, "model.n_kv_heads": 2,
            "model.rope_theta": 5000.0, "model.norm_eps": 1e-6, "model.max_seq_len": 256,
            "model.qk_norm": "false"}  # Llama unless a test asks for QK-norm (Qwen3)
    sets.update(overrides)
    cfg = tiny_config(tmp, corpus, **sets)
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    model.reset_parameters(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        model.output.weight.mul_(20)
    return save_checkpoint(tmp / "run", 0, model, cfg, tok.folder)
