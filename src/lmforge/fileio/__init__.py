"""The one writer for every output lmforge makes: folders and files, atomically.

Rules (docs/design.md, "Outputs and errors"), enforced here for every command; each module
states the rules it keeps:

    ownership   the marker (`MARKER_FILE`): an output folder is written only if it is absent,
                empty, or the same command's earlier output (`check_output`, `describe`); no
                output is, holds or lies inside one of its command's inputs (`check_not_input`)
    locking     one writer per output: the `.NAME.lock` beside it (`output_lock`)
    durable     fsync, and moving a complete folder into place (`replace_dir`)
    failures    what the operating system refused, as a `FileSystemError` (`write_failure`)
    writers     `atomic_dir`, `atomic_file`, `user_file`, `write_text`, `write_json`,
                `copy_file`, `open_append`, `open_run_dir`: temporaries, then a rename
    paths       input checks and path text (`path_text`, `shown_path`, `check_path_text`,
                `check_readable`, `loads_json`)
    native      safetensors and tokenizers for any path (`load_safetensors`, ...)

This package is the one import surface: import from `lmforge.fileio`. A test that patches a
name patches it in the module whose code reads it (`fileio.writers.write_marker`,
`fileio.durable.exchange_paths`), not here.
"""

from lmforge.fileio.paths import (FS_BYTES_PREFIX, check_path_text, check_readable, loads_json, path_from_text,
                                  path_text, shown_path)
from lmforge.fileio.ownership import (KINDS, MARKER_FILE, NESTING, OutputError, check_not_input,
                                      check_not_inside_output, check_output, describe, mode_kind, read_capped,
                                      read_marker, special_kind, SpecialFile)
from lmforge.fileio.locking import make_parent, output_lock
from lmforge.fileio.durable import exchange_paths, check_removable, fsync_path, fsync_tree, replace_dir
from lmforge.fileio.failures import NEARLY_FULL, write_failure
from lmforge.fileio.writers import (AppendFile, atomic_dir, atomic_file, check_user_file, copy_file, make_folder,
                                    open_append, open_run_dir, user_file, write_json, write_marker, write_text)
from lmforge.fileio.native import (SafetensorsReader, load_hf_tokenizer, load_safetensors, safetensors_metadata,
                                   save_hf_tokenizer, save_safetensors)

__all__ = ["MARKER_FILE", "OutputError", "AppendFile", "open_append", "copy_file", "check_path_text", "check_readable", "make_folder", "special_kind", "mode_kind", "read_capped", "SpecialFile",
           "write_failure", "atomic_dir", "atomic_file", "check_output", "check_not_input", "check_not_inside_output",
           "check_user_file", "describe", "make_parent", "open_run_dir", "user_file",
           "output_lock", "read_marker", "replace_dir", "write_json", "write_marker", "write_text", "fsync_tree"]
#: Also reached as `fileio.X` when it was one module: path text and input checks, the native readers
#: and writers, the marker tables, fsync; `exchange_paths` and `NEARLY_FULL` to read only (a patch here
#: changes nothing: patch them in `durable` and `failures`, where they are read).
__all__ += ["SafetensorsReader", "FS_BYTES_PREFIX", "KINDS", "NESTING", "check_removable", "fsync_path", "load_hf_tokenizer",
            "load_safetensors", "loads_json", "path_from_text", "path_text", "safetensors_metadata",
            "save_hf_tokenizer", "save_safetensors", "shown_path", "NEARLY_FULL", "exchange_paths"]
