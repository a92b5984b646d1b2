"""What an export says about the model: a model card for the Hugging Face folder, and the same
facts for GGUF's `general.*` keys.

The card is the Hub's format (`README.md` with YAML front matter: `library_name`, `tags`,
`base_model` when the chain of runs starts from an imported model, `datasets`; the license is
left for you to set) and a body written from the run folders themselves: every stage of the
chain that made the checkpoint (the run's `.lmforge-output` names its command; `train.init`,
`sft.init`, `dpo.init` and `rl.init` lead to the run before), each with its data, steps, tokens,
last training loss and held-out loss (from its `metrics.jsonl`), the architecture, and the
evaluation suite `lmforge eval --tasks --out FILE` wrote for this checkpoint when the export is
given it (`--evaluation FILE`; one of another checkpoint is refused). Nothing is invented: a
fact the folders do not hold is left out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: The `[section] init` key that names the checkpoint a run of each command started from.
INIT_KEYS = {"pretrain": ("train", "init"), "sft": ("sft", "init"), "dpo": ("dpo", "init"), "rl": ("rl", "init")}
DATA_KEYS = {"pretrain": ("data", "source"), "sft": ("sft", "data"), "dpo": ("dpo", "data"), "rl": ("rl", "data")}
MAX_CHAIN = 16


@dataclass
class Stage:
    """One run of the chain: its command, folder, data, and what its metrics say."""

    command: str
    folder: Path
    data: str = ""
    steps: int | None = None
    tokens: int | None = None
    loss: float | None = None
    val_loss: float | None = None
    seconds: float | None = None
    init: str = ""


def _read_json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
        return out if isinstance(out, dict) else {}
    except (OSError, ValueError):
        return {}


def _run_folder(checkpoint: Path) -> Path:
    return checkpoint.parent if checkpoint.name.startswith("step_") else checkpoint


def _config(folder: Path) -> dict:
    import tomllib

    try:
        return tomllib.loads((folder / "config.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _stage(run: Path) -> Stage | None:
    command = _read_json(run / ".lmforge-output").get("command", "")
    if command not in INIT_KEYS and command != "import-hf":
        return None
    st = Stage(command, run)
    cfg = _config(run)
    if command in INIT_KEYS:
        sec, key = DATA_KEYS[command]
        st.data = str(cfg.get(sec, {}).get(key, ""))
        sec, key = INIT_KEYS[command]
        st.init = str(cfg.get(sec, {}).get(key, ""))
        last, val = {}, None
        try:
            for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
                row = json.loads(line) if line.strip() else {}
                if "loss" in row or "reward" in row:
                    last = row
                if "val_loss" in row:
                    val = row["val_loss"]
        except (OSError, ValueError):
            pass
        st.steps, st.tokens, st.seconds = last.get("step"), last.get("tokens"), last.get("elapsed_s")
        st.loss, st.val_loss = last.get("loss"), val
    return st


def training_chain(checkpoint: str | Path) -> list[Stage]:
    """The runs that made `checkpoint`, first to last (as far as the folders lead)."""
    chain: list[Stage] = []
    run = _run_folder(Path(checkpoint))
    seen = set()
    while run is not None and len(chain) < MAX_CHAIN and run.resolve() not in seen:
        seen.add(run.resolve())
        st = _stage(run)
        if st is None:
            break
        chain.append(st)
        nxt = Path(st.init) if st.init else None
        run = _run_folder(nxt) if nxt is not None and nxt.exists() else None
    return chain[::-1]


#: The largest evaluation JSON read (a results file of thousands of tasks is a few MB).
MAX_EVALUATION_BYTES = 64 << 20


def read_evaluation(path: str | Path, checkpoint: str | Path) -> dict:
    """The results JSON of `lmforge eval --tasks --out FILE`, checked to be this checkpoint's and
    to hold what the card prints: every figure a finite number (`check_results`).

    Raises:
        ExportError: the file is missing, not a regular file, too large, not such a JSON, holds a
        figure that is not a finite number (naming the file and the key), or records another checkpoint.
    """
    from lmforge.export.options import ExportError

    path = Path(path)
    res = _read_results(path, ExportError)
    if not isinstance(res.get("tasks"), dict) or "suite" not in res:
        raise ExportError(f"--evaluation {path}: not a results JSON of `lmforge eval --tasks ... --out FILE` (it has "
                          f"\"tasks\" and \"suite\").")
    check_results(res, f"--evaluation {path}", ExportError)
    theirs, ours = Path(str(res.get("checkpoint", ""))), Path(checkpoint)
    if _run_folder(theirs).resolve() != _run_folder(ours).resolve() or (
            theirs.name.startswith("step_") and ours.name.startswith("step_") and theirs.name != ours.name):
        raise ExportError(f"--evaluation {path} scored the checkpoint {theirs}, not {ours}: the card would describe "
                          f"another model. Evaluate this one (lmforge eval --checkpoint {ours} --tasks builtin --out "
                          f"FILE) and pass that file.")
    return res


def _read_results(path: Path, error: type[Exception]) -> dict:
    """The JSON object of `path`, read only from a regular file of at most MAX_EVALUATION_BYTES (a
    FIFO would block the export, a device never end)."""
    from lmforge.fileio import SpecialFile, loads_json, read_capped, shown_path

    where = f"--evaluation {shown_path(path)}"
    try:
        data = read_capped(path, MAX_EVALUATION_BYTES)
    except SpecialFile as exc:
        raise error(f"{where} is {exc.kind}, not a regular file; give the results JSON `lmforge eval --tasks ... "
                    f"--out FILE` wrote.") from None
    except OSError as exc:
        what = "no such file" if not (path.exists() or path.is_symlink()) else f"cannot be read ({exc.strerror})"
        raise error(f"{where}: {what}; give the results JSON `lmforge eval --tasks ... --out FILE` wrote.") from None
    if len(data) > MAX_EVALUATION_BYTES:
        raise error(f"{where}: larger than {MAX_EVALUATION_BYTES >> 20} MiB; a results JSON of `lmforge eval "
                    f"--tasks` is far smaller. Give that file.")
    try:
        res = loads_json(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{where}: not a results JSON of `lmforge eval --tasks ... --out FILE` (not readable JSON: "
                    f"{str(exc)[:120]}).") from None
    if not isinstance(res, dict):
        raise error(f"{where}: not a results JSON of `lmforge eval --tasks ... --out FILE` (a JSON "
                    f"{type(res).__name__}, not an object).")
    return res


def _finite(value) -> bool:
    import math

    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_results(res: dict, where: str, error: type[Exception]) -> None:
    """Every figure of an evaluation's results that the card prints is a finite number (a count
    a non-negative integer), else `error` naming `where`, the key and the value: text would stop
    the export with a traceback, NaN would be printed as "nan%"."""
    from lmforge.data.records import short

    def bad(key: str, value, expected: str):
        return error(f"{where}: {key} = {short(value)}: expected {expected}. The file is not what `lmforge eval "
                     f"--tasks ... --out FILE` writes: evaluate again and pass that file.")

    if not _finite(res["suite"]):
        raise bad("suite", res["suite"], "a finite number (the mean centred score)")
    for name, r in res["tasks"].items():
        key = f"tasks.{name}"
        if not isinstance(r, dict):
            raise bad(key, r, "an object of the task's figures")
        if not isinstance(r.get("kind"), str):
            raise bad(f"{key}.kind", r.get("kind"), "\"choice\" or \"continuation\"")
        n = r.get("n")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise bad(f"{key}.n", n, "the number of items, an integer >= 0")
        for field in ("accuracy", "baseline", "centred", *(("accuracy_sum",) if "accuracy_sum" in r else ())):
            if not _finite(r.get(field)):
                raise bad(f"{key}.{field}", r.get(field), "a finite number")
        interval = r.get("interval")
        if not (isinstance(interval, list) and len(interval) == 2 and all(_finite(x) for x in interval)):
            raise bad(f"{key}.interval", interval, "[low, high], two finite numbers")
        if r.get("pass@k"):
            if not isinstance(r["pass@k"], dict):
                raise bad(f"{key}.pass@k", r["pass@k"], "an object {k: rate}")
            for k, v in r["pass@k"].items():
                if not _finite(v):
                    raise bad(f"{key}.pass@k.{k}", v, "a finite number")
            samples = r.get("samples")
            if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
                raise bad(f"{key}.samples", samples, "the number of samples, an integer >= 0")
            if not _finite(r.get("temperature")):
                raise bad(f"{key}.temperature", r.get("temperature"), "a finite number")


def _num(v, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "-"


def model_card(checkpoint: str | Path, model, contract, name: str, evaluation: dict | None = None) -> str:
    """The README.md of a Hugging Face export (module docstring); `model`: the Transformer;
    `evaluation`: a results JSON of `lmforge eval --tasks` (`read_evaluation`)."""
    chain = training_chain(checkpoint)
    facts = chain_facts(chain)
    tags = ["lmforge", "llama", "text-generation", *[c for c in facts["commands"] if c != "pretrain"]]
    front = ["---", "library_name: transformers", "# license: set yours here (e.g. apache-2.0)", "tags:"]
    front += [f"- {t}" for t in tags]
    if facts["base_model"]:
        front.append(f"base_model: {json.dumps(facts['base_model'])}")
    if facts["datasets"]:
        front += ["datasets:"] + [f"- {json.dumps('python-stdlib (embedded in lmforge)' if d == 'stdlib' else d)}"
                                  for d in facts["datasets"]]
    front.append("---")
    m = model.config
    params = sum(p.numel() for p in model.parameters())
    body = [f"# {name}", "", "A language model trained with lmforge (tokenizer, pretraining and tuning on one "
            "training loop), exported as a Hugging Face Llama folder.", "",
            "## Model", "",
            f"Llama architecture: {params:,} parameters; {m.n_layers} layers, dim {m.dim}, {m.n_heads} heads "
            f"({m.n_kv_heads} key/value), vocabulary {contract.vocab_size}, context {m.max_seq_len} tokens"
            + (", QK-norm" if m.qk_norm else "") + ".", "", "## Training", ""]
    if chain:
        body += ["| stage | data | steps | tokens | last loss | held-out loss | seconds |", "|---|---|---|---|---|---|---|"]
        for s in chain:
            body.append(f"| {s.command} | {s.data or '-'} | {_num(s.steps, 'd')} | {_num(s.tokens, ',d')} | "
                        f"{_num(s.loss, '.4f')} | {_num(s.val_loss, '.4f')} | {_num(s.seconds, '.0f')} |")
    else:
        body.append("The run folders of this checkpoint were not found; nothing is claimed about its training.")
    res = evaluation
    body += ["", "## Evaluation", ""]
    if res:
        from lmforge.evals.suite import results_table

        body += [f"`lmforge eval --tasks` (seed {res.get('seed')}, at most {res.get('limit')} items a task): "
                 "accuracy with its 95% interval, the random baseline, and the centred score "
                 "(accuracy − baseline) / (1 − baseline).", "", results_table(res)]
    else:
        body.append("No evaluation suite was given to the export (`lmforge eval --checkpoint CKPT --tasks builtin "
                    "--out FILE`, then `lmforge export --evaluation FILE`).")
    body += ["", "## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
             "tok = AutoTokenizer.from_pretrained(\"PATH\")", "model = AutoModelForCausalLM.from_pretrained(\"PATH\")",
             "```", ""]
    return "\n".join(front + [""] + body)


def chain_facts(chain: list[Stage]) -> dict:
    """What the card and the GGUF keys say of a chain: its training commands and datasets (sorted,
    once each), the imported model it starts from ("" for none), and a one-line description."""
    return {"commands": sorted({s.command for s in chain if s.command in INIT_KEYS}),
            "datasets": sorted({s.data for s in chain if s.data}),
            "base_model": next((str(s.folder) for s in chain if s.command == "import-hf"), ""),
            "description": "lmforge: " + " -> ".join(
                s.command + (f" on {s.data}" if s.data else "") + (f", {s.steps} steps" if s.steps else "")
                for s in chain) if chain else ""}


def gguf_facts(checkpoint: str | Path) -> dict:
    """What GGUF's `general.*` keys can carry of the card: {"description", "tags", "datasets",
    "base_model"} (absent when unknown)."""
    facts = chain_facts(training_chain(checkpoint))
    out = {"tags": ["lmforge", *facts["commands"]]}
    out.update({k: facts[k] for k in ("description", "datasets", "base_model") if facts[k]})
    return out


MODEL_CARD_FILE = "README.md"

__all__ = ["MODEL_CARD_FILE", "Stage", "chain_facts", "check_results", "gguf_facts", "model_card", "read_evaluation",
           "training_chain"]
