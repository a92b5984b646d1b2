"""Export to other runtimes: the Hugging Face format (`hf`; its config.json `hf_config_out`), and back
(`hf_in.import_hf`; config.json `hf_config_in`); GGUF for llama.cpp (`gguf`; its tokenizer `gguf_vocab`,
its architectures `llama_cpp`), and back (`gguf_in.import_gguf`); PEFT adapters (`peft`)."""

from lmforge.export.gguf import GGUF_DTYPES, export_gguf
from lmforge.export.gguf_in import import_gguf
from lmforge.export.options import EXPORT_DTYPES, check_export_options
from lmforge.export.peft import export_peft
from lmforge.export.hf import (ExportError, export_hf, generation_config, map_name, require_transformers, to_hf_state,
                               verify_export)
from lmforge.export.hf_config_out import hf_config
from lmforge.export.hf_in import import_hf

__all__ = ["EXPORT_DTYPES", "ExportError", "GGUF_DTYPES", "check_export_options", "export_gguf", "export_hf", "export_peft",
           "generation_config", "hf_config", "import_gguf", "import_hf", "map_name", "require_transformers",
           "to_hf_state", "verify_export"]
