"""The lmforge model: one Llama-style Transformer, its attention backends, and its decode path
(`decode`: the KV cache and the fused T = 1 step)."""

from lmforge.model.decode import KVCache
from lmforge.model.transformer import Transformer, resolve_model_config
from lmforge.model.load import load_model  # also binds Transformer.from_checkpoint

__all__ = ["KVCache", "Transformer", "load_model", "resolve_model_config"]
