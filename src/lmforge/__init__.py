"""lmforge: train small language models end to end, without the silent bugs.

Stages: tokenizer (train or import) -> prepare -> pretrain (or continue a checkpoint) -> sft ->
dpo (the DPO family) -> rl (verifiable rewards), each full or LoRA -> generate / chat / eval ->
export (Hugging Face, GGUF, PEFT) / serve (an OpenAI-compatible API); a user's own model (Llama,
Mistral, Qwen2/3, Gemma 3/2, OLMo 2) comes in through import-hf or import-gguf.
See README.md, docs/design.md (the architecture) and docs/pitfalls.md (the pitfall table P1-P7 this package rules out).
"""

from lmforge.errors import LmforgeError

__version__ = "0.1.0"
__all__ = ["LmforgeError", "__version__"]
