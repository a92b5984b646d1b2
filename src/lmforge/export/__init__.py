"""Export to other runtimes: the Hugging Face format (`hf`), and back (`import_hf`)."""

from lmforge.export.hf import (ExportError, export_hf, generation_config, hf_config, import_hf, map_name,
                               require_transformers, to_hf_state, verify_export)

__all__ = ["ExportError", "export_hf", "generation_config", "hf_config", "import_hf", "map_name",
           "require_transformers", "to_hf_state", "verify_export"]
