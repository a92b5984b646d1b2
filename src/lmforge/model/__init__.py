"""The lmforge model: one Llama-style Transformer and its attention backends."""

from lmforge.model.transformer import KVCache, Transformer, load_model, resolve_model_config

__all__ = ["KVCache", "Transformer", "load_model", "resolve_model_config"]
