"""lmforge: train small language models end to end, without the silent bugs.

Stages: tokenizer -> prepare -> pretrain -> sft -> generate / eval -> export.
See README.md, docs/design.md (the architecture) and docs/pitfalls.md (the pitfall table P1-P7 this package rules out).
"""

from lmforge.errors import LmforgeError

__version__ = "0.1.0"
__all__ = ["LmforgeError", "__version__"]
