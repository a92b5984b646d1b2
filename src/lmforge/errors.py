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


class TrainingError(LmforgeError):
    """Training cannot go on: a non-finite loss, gradient or weight (the step is not taken)."""


def require_package(module: str, extra: str | None, purpose: str, error: type[LmforgeError] = LmforgeError,
                    package: str | None = None):
    """Import the optional `module` and return it, or explain how to install it: the one
    handling of a missing optional package.

    `extra` is the pyproject extra that installs it (None: the package alone), `purpose` what
    needs it ("GGUF export"), `package` its name on PyPI when not the module's top name.

    Raises:
        `error` (an LmforgeError): the module cannot be imported; the message names the package
        and the command that installs it.
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        name = package or module.split(".")[0]
        how = (f'pip install "lmforge[{extra}]" (in a clone of lmforge: pip install -e ".[{extra}]")' if extra
               else f"pip install {name}")
        raise error(f"{purpose} needs the {name} package: {name} is not installed. Install it: {how}.") from None


class Interrupted(Exception):
    """A command stopped by SIGINT/SIGTERM after saving what it could; the command line
    exits 128 + `signum` (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message or f"stopped by signal {signum}")
        self.signum = signum


#: Signals received by the command line's handler (lmforge.cli). Native code that runs Python
#: callbacks (the Rust BPE trainer) can swallow the exception a handler raises; it calls
#: `raise_if_stopped()` when it returns, so the stop is never lost.
_STOP_REQUESTS: list[int] = []


def request_stop(signum: int) -> None:
    _STOP_REQUESTS.append(signum)


def raise_if_stopped() -> None:
    if _STOP_REQUESTS:
        raise Interrupted(_STOP_REQUESTS[-1])
