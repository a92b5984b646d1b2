"""The lmforge model: one Transformer (Llama's layout, and the imported families' mechanisms as
`ModelConfig` fields), its attention backends, its loss, LoRA, the checkpoint layout, and its
decode path (`decode`: the KV cache and the fused T = 1 step)."""

from lmforge.model.decode import KVCache
from lmforge.model.transformer import Transformer, resolve_model_config
from lmforge.model.load import load_model  # also binds Transformer.from_checkpoint

__all__ = ["KVCache", "Transformer", "load_model", "resolve_model_config"]
