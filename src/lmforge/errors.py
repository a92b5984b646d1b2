"""The one exception family lmforge raises for bad input.

Every message names the file or field, the value seen, the value expected and
what to do. The command line prints the message (no traceback) and exits 2.
"""


class LmforgeError(Exception):
    """Base class: bad input or inconsistent artefacts, explained for a user."""


class ConfigError(LmforgeError):
    """A config file, key, value or command-line override is wrong."""


class ContractError(LmforgeError):
    """Tokenizer, data, model and checkpoint disagree (P1, P4, P6)."""


class DataError(LmforgeError):
    """A corpus, shard or SFT file is missing, empty or malformed."""


class CheckpointError(LmforgeError):
    """A checkpoint folder is missing, incomplete or does not match."""
