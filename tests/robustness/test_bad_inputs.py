"""The robustness table: one row per bad input, across every command.

Each row runs the real command line (`lmforge.cli.main`) in a fresh copy of a small
project (tokenizer, data, a pretraining run with two checkpoints, an SFT run, a Hugging
Face export, conversation files) after damaging that copy as the row says, and asserts:
exit code 2, exactly one `error:` line whose text matches the row's words, no traceback,
and every file of the copy (and of the folder around it) byte-identical before and after:
nothing lost, nothing half-written, no stray output, no lock or temporary left behind.

Classes covered: config values (non-finite, out of range, wrong type, unknown key, bad
choice, bad shape), config files (missing, a folder, not UTF-8, not TOML, wrong shape),
output paths (an existing file, `.`, a parent, a run, a checkpoint, a data folder, a
tokenizer folder, an SFT run, a user's folder) for every writing command, resume (wrong
stage, wrong folder, missing or damaged optimizer / RNG / state files), corpora (JSONL and
Parquet of any shape, invalid Unicode, damaged files), SFT data, checkpoints (damaged or
non-finite weights, edited contract, damaged config), data folders, tokenizer folders,
Hugging Face folders of any shape.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import replace as dc_replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import make_corpus, tiny_config  # noqa: E402

from lmforge.cli import main  # noqa: E402


# -- the project ---------------------------------------------------------------------------------
def conversations(n: int = 24) -> list[dict]:
    words = ["value", "return", "self", "data", "items", "key", "name", "result"]
    return [{"messages": [{"role": "user", "content": f"{i}: " + " ".join(words[(i + j) % 8] for j in range(4))},
                          {"role": "assistant", "content": " ".join(words[(3 * i + j) % 8] for j in range(3))}]}
            for i in range(n)]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """tok/, data/, run/ (step_000001, step_000002), sft/, hf/, corpus/, chat.jsonl, cfg.toml,
    notes.txt and mine/ (a user's file and folder); relative paths, so a copy works alone."""
    import os

    from lmforge.stages import export_stage, prepare_stage, pretrain_stage, sft_stage, train_tokenizer_stage

    root = tmp_path_factory.mktemp("project")
    here = os.getcwd()
    os.chdir(root)
    try:
        make_corpus(root / "corpus", n_docs=30)
        cfg = tiny_config(root, None, **{"tokenizer.dir": "tok", "data.dir": "data", "data.source": "corpus",
                                         "train.steps": 2, "train.checkpoint_every": 1, "train.keep_last": 0})
        cfg.save(root / "cfg.toml")
        train_tokenizer_stage(cfg, progress=False)
        prepare_stage(cfg, progress=False)
        pretrain_stage(cfg, "run", progress=False)
        (root / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations()), encoding="utf-8")
        sft = dc_replace(cfg, sft=dc_replace(cfg.sft, init="run", data="chat.jsonl", steps=1, micro_batch_size=2,
                                             val_examples=0), data=dc_replace(cfg.data, val_fraction=0.25))
        sft_stage(sft, "sft", progress=False)
        export_stage("run", "hf")
        (root / "notes.txt").write_text("a user's notes\n")
        (root / "mine").mkdir()
        (root / "mine" / "thesis.tex").write_text("years of work\n")
    finally:
        os.chdir(here)
    return root


def tree_hash(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "link" if p.is_symlink() else "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# -- damage --------------------------------------------------------------------------------------
def write(rel: str, data: bytes | str) -> Callable[[Path], None]:
    def f(p: Path) -> None:
        path = p / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return f


def remove(rel: str) -> Callable[[Path], None]:
    def f(p: Path) -> None:
        target = p / rel
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    return f


def truncate(rel: str, keep: int) -> Callable[[Path], None]:
    def f(p: Path) -> None:
        data = (p / rel).read_bytes()
        (p / rel).write_bytes(data[:keep])
    return f


def edit_json(rel: str, fn: Callable) -> Callable[[Path], None]:
    def f(p: Path) -> None:
        obj = json.loads((p / rel).read_text())
        new = fn(obj)
        (p / rel).write_text(json.dumps(obj if new is None else new))
    return f


def nan_weights(rel: str) -> Callable[[Path], None]:
    def f(p: Path) -> None:
        from safetensors.torch import load_file, save_file

        state = load_file(str(p / rel))
        name = sorted(state)[0]
        state[name] = state[name].clone()
        state[name].view(-1)[0] = float("nan")
        save_file(state, str(p / rel))
    return f


def parquet(rel: str, table: dict) -> Callable[[Path], None]:
    def f(p: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table(table), p / rel)
    return f


def both(*fs: Callable[[Path], None]) -> Callable[[Path], None]:
    def f(p: Path) -> None:
        for g in fs:
            g(p)
    return f


def setcfg(text: str) -> Callable[[Path], None]:
    return write("cfg.toml", text)


# -- the rows ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    id: str
    argv: tuple[str, ...]
    match: str
    damage: Callable[[Path], None] | None = None


C = ("--config", "cfg.toml")
PRETRAIN = ("pretrain", *C, "--out", "newrun", "--no-progress")
PREPARE = ("prepare", *C, "--out", "newdata", "--no-progress")
TOKENIZE = ("train-tokenizer", *C, "--out", "newtok", "--no-progress")
SFT_SETS = ("--set", "sft.init=run", "--set", "sft.data=chat.jsonl", "--set", "sft.val_examples=0",
            "--set", "data.val_fraction=0.25", "--set", "sft.steps=1", "--set", "sft.micro_batch_size=2")
SFT = ("sft", *C, *SFT_SETS, "--out", "newsft", "--no-progress")
GENERATE = ("generate", *C, "--checkpoint", "run", "--prompt", "def", "--max-new-tokens", "4")
CHAT = ("chat", *C, "--checkpoint", "sft", "--max-new-tokens", "4")
EVAL = ("eval", "--checkpoint", "run")
EXPORT = ("export", "--checkpoint", "run", "--out", "newhf")
IMPORT_HF = ("import-hf", "hf", "--out", "newimp")
IMPORT_TOK = ("import-tokenizer", *C, "--from", "hf", "--out", "newtok2")
SPEEDRUN = ("speedrun", *C, "--out", "sp", "--no-progress")

ROWS: list[Row] = []


def add(id: str, argv, match: str, damage=None) -> None:
    ROWS.append(Row(id, tuple(argv), match, damage))


# 1. config values through --set, on the command that trains (every key class)
BAD_SETS = [
    ("lr-nan", "train.lr=nan", r"train\.lr = nan: expected a finite number"),
    ("lr-inf", "train.lr=inf", r"train\.lr = inf: expected a finite number"),
    ("lr-neg", "train.lr=-1e-3", r"train\.lr = -0\.001: expected 0\.0 < value"),
    ("lr-zero", "train.lr=0", r"train\.lr = 0\.0: expected 0\.0 < value"),
    ("beta1-2", "train.beta1=2", r"train\.beta1 = 2\.0: expected 0\.0 <= value < 1\.0"),
    ("beta1-neg", "train.beta1=-0.1", r"train\.beta1 = -0\.1"),
    ("beta2-1", "train.beta2=1", r"train\.beta2 = 1\.0: expected 0\.0 <= value < 1\.0"),
    ("beta2-nan", "train.beta2=nan", r"train\.beta2 = nan: expected a finite number"),
    ("clip-nan", "train.grad_clip=nan", r"train\.grad_clip = nan"),
    ("clip-neg", "train.grad_clip=-1", r"train\.grad_clip = -1\.0: expected 0\.0 <= value"),
    ("wd-neg", "train.weight_decay=-0.1", r"train\.weight_decay = -0\.1"),
    ("wd-inf", "train.weight_decay=-inf", r"train\.weight_decay = -inf: expected a finite number"),
    ("minlr-2", "train.min_lr_ratio=2", r"train\.min_lr_ratio = 2\.0"),
    ("decay-0", "train.decay_fraction=0", r"train\.decay_fraction = 0\.0"),
    ("steps-0", "train.steps=0", r"train\.steps = 0: expected 1 <= value"),
    ("steps-float", "train.steps=1.5", r"train\.steps = 1\.5 has type float, expected int.*train\.steps=600"),
    ("steps-str", "train.steps=many", r"train\.steps = 'many' has type str, expected int"),
    ("mbs-0", "train.micro_batch_size=0", r"train\.micro_batch_size = \"auto\" \(or 0\) needs train\.global_batch_size"),
    ("accum-neg", "train.grad_accum_steps=-2", r"train\.grad_accum_steps = -2"),
    ("warmup-neg", "train.warmup_steps=-1", r"train\.warmup_steps = -1"),
    ("keep-neg", "train.keep_last=-1", r"train\.keep_last = -1"),
    ("seed-neg", "train.seed=-5", r"train\.seed = -5"),
    ("log-0", "train.log_every=0", r"train\.log_every = 0"),
    ("time-nan", "train.time_limit_s=nan", r"train\.time_limit_s = nan"),
    ("schedule", "train.schedule=linear", r"train\.schedule = 'linear' is not one of"),
    ("precision", "train.precision=fp16", r"train\.precision = 'fp16' is not one of"),
    ("dp", "train.data_parallel=zero3", r"train\.data_parallel = 'zero3' is not one of"),
    ("cp-0", "train.context_parallel=0", r"train\.context_parallel = 0"),
    ("cp-2", "train.context_parallel=2", r"not divisible by train\.context_parallel = 2"),
    ("gbs", "train.global_batch_size=6", r"global_batch_size"),
    ("compile-str", "train.compile=yes", r"train\.compile = 'yes' has type str, expected bool"),
    ("dim-0", "model.dim=0", r"model\.dim = 0: expected 1 <= value"),
    ("dim-heads", "model.dim=30", r"model\.dim = 30 is not divisible by model\.n_heads = 4"),
    ("kv-heads", "model.n_kv_heads=3", r"model\.n_heads = 4 is not divisible by model\.n_kv_heads = 3"),
    ("odd-head", "model.dim=36", r"odd; rotary embeddings need an even head size"),
    ("eps-0", "model.norm_eps=0", r"model\.norm_eps = 0\.0: expected 0\.0 < value"),
    ("eps-nan", "model.norm_eps=nan", r"model\.norm_eps = nan"),
    ("theta-neg", "model.rope_theta=-1", r"model\.rope_theta = -1\.0"),
    ("theta-inf", "model.rope_theta=inf", r"model\.rope_theta = inf"),
    ("ffn-neg", "model.ffn_dim=-64", r"model\.ffn_dim = -64"),
    ("vocab-neg", "model.vocab_size=-1", r"model\.vocab_size = -1"),
    ("vocab-small", "model.vocab_size=100", r"model\.vocab_size = 100.*tokenizer"),
    ("attention", "model.attention=flash", r"model\.attention = 'flash' is not one of"),
    ("flex-cpu", "model.attention=flex", r"flex"),
    ("seqlen-0", "data.seq_len=0", r"data\.seq_len = 0"),
    ("seqlen-max", "data.seq_len=4096", r"data\.seq_len = 4096 exceeds model\.max_seq_len"),
    ("valfrac-1", "data.val_fraction=1", r"data\.val_fraction = 1\.0"),
    ("valfrac-nan", "data.val_fraction=nan", r"data\.val_fraction = nan"),
    ("badutf8", "data.on_bad_utf8=ignore", r"data\.on_bad_utf8 = 'ignore' is not one of"),
    ("temp-neg", "generate.temperature=-1", r"generate\.temperature = -1\.0"),
    ("topp-0", "generate.top_p=0", r"generate\.top_p = 0\.0"),
    ("topk-neg", "generate.top_k=-1", r"generate\.top_k = -1"),
    ("rep-0", "generate.repetition_penalty=0", r"generate\.repetition_penalty = 0\.0"),
    ("maxnew-0", "generate.max_new_tokens=0", r"generate\.max_new_tokens = 0"),
    ("sft-lr-nan", "sft.lr=nan", r"sft\.lr = nan"),
    ("sft-steps-0", "sft.steps=0", r"sft\.steps = 0"),
    ("tok-vocab-0", "tokenizer.vocab_size=0", r"tokenizer\.vocab_size = 0"),
    ("unknown-key", "train.stepz=3", r"unknown key train\.stepz\. Did you mean 'steps'"),
    ("unknown-section", "trainer.steps=3", r"unknown section 'trainer'"),
    ("no-equals", "train.steps", r"expected section\.key=value"),
    ("no-dot", "steps=3", r"expected section\.key=value"),
]
for rid, s, m in BAD_SETS:
    add(f"set-{rid}", (*PRETRAIN[:1], *C, "--set", s, "--out", "newrun", "--no-progress"), m)
# the same class reaches every command that reads a config
for cmd in (PREPARE, TOKENIZE, SFT, GENERATE, CHAT, SPEEDRUN, IMPORT_TOK):
    for rid, s, m in (BAD_SETS[0], BAD_SETS[4], BAD_SETS[35], BAD_SETS[57]):
        add(f"{cmd[0]}-set-{rid}", (*cmd[:1], "--set", s, *cmd[1:]), m)

# 2. config files
add("cfg-missing", ("pretrain", "--config", "nope.toml", "--out", "newrun"), r"config file nope\.toml does not exist")
add("cfg-folder", ("pretrain", "--config", "data", "--out", "newrun"), r"config file data does not exist")
add("cfg-not-utf8", PRETRAIN, r"cfg\.toml: not UTF-8 text", setcfg(b"[train]\nsteps = 2 # \xff\xfe\n"))
add("cfg-not-toml", PRETRAIN, r"cfg\.toml: not valid TOML", setcfg("[train\nsteps = 2\n"))
add("cfg-section-not-table", PRETRAIN, r"\[train\] must be a table", setcfg("train = 3\n"))
add("cfg-unknown-section", PRETRAIN, r"unknown section \[trian\]\. Did you mean 'train'", setcfg("[trian]\nsteps = 2\n"))
add("cfg-bad-type", PRETRAIN, r"data\.seq_len = '64' has type str, expected int.*data\.seq_len=256",
    setcfg('[data]\nseq_len = "64"\n'))
add("cfg-nan", PRETRAIN, r"train\.lr = nan", setcfg("[train]\nlr = nan\n"))
add("cfg-array", PRETRAIN, r"train\.lr = \[.*has type list", setcfg("[train]\nlr = [1, 2]\n"))

# 3. output paths: every writing command refuses what it did not write, and changes nothing
OUT_CMDS = {
    "train-tokenizer": TOKENIZE, "import-tokenizer": IMPORT_TOK, "prepare": PREPARE, "pretrain": PRETRAIN,
    "sft": SFT, "export": EXPORT, "import-hf": IMPORT_HF, "speedrun": SPEEDRUN,
}
TARGETS = {
    "file": ("notes.txt", r"an existing file"),
    "cwd": (".", r"current folder or one of its parents"),
    "parent": ("..", r"current folder or one of its parents"),
    "userdir": ("mine", r"lmforge did not write.*thesis\.tex"),
    "run": ("run", r"a pretraining run folder"),
    "checkpoint": ("run/step_000001", r"a checkpoint"),
    "data": ("data", r"a prepared data folder"),
    "tokenizer": ("tok", r"a tokenizer folder"),
    "sftrun": ("sft", r"an SFT run folder"),
    "export": ("hf", r"a Hugging Face export folder"),
}
OWN = {"train-tokenizer": "tokenizer", "import-tokenizer": "tokenizer", "prepare": "data", "pretrain": "run",
       "sft": "sftrun", "export": "export"}
for name, argv in OUT_CMDS.items():
    for tname, (target, m) in TARGETS.items():
        if OWN.get(name) == tname:
            continue  # replacing its own earlier output is allowed (a training run then needs --resume)
        i = argv.index("--out")
        if name in ("import-tokenizer", "import-hf") and tname == "export":
            m = r"is the --from folder|" + m  # hf/ is also their source
        add(f"out-{name}-{tname}", (*argv[:i + 1], target, *argv[i + 2:]), m)
add("out-pretrain-own-run-without-resume", ("pretrain", *C, "--out", "run", "--no-progress"),
    r"already holds a `lmforge pretrain` run with checkpoints\. Pass --resume")
add("out-sft-own-run-without-resume", ("sft", *C, *SFT_SETS, "--out", "sft", "--no-progress"),
    r"already holds a `lmforge sft` run with checkpoints\. Pass --resume")
add("out-eval-folder", (*EVAL, "--out", "data"), r"--out data is a folder")
add("out-export-is-init", ("sft", *C, *SFT_SETS, "--out", "run", "--no-progress"),
    r"is the checkpoint being fine-tuned|a pretraining run folder")
add("out-tmp-names-are-not-ours", PREPARE, r"an existing file",
    both(write("newdata.tmp/keep.txt", "mine"), write(".tmp-newdata/keep.txt", "mine"), write("newdata", "a file")))

# 4. resume: only what can be continued exactly
add("resume-sft-on-pretrain-run", ("sft", *C, *SFT_SETS, "--set", "sft.init=run/step_000001", "--resume",
                                   "--out", "run", "--set", "train.keep_last=1", "--no-progress"),
    r"is the checkpoint being fine-tuned|a pretraining run folder")
add("resume-pretrain-on-sft-run", ("pretrain", *C, "--resume", "--out", "sft", "--no-progress"), r"an SFT run folder")
add("resume-pretrain-on-data", ("pretrain", *C, "--resume", "--out", "data", "--no-progress"), r"a prepared data folder")
add("resume-pretrain-on-checkpoint", ("pretrain", *C, "--resume", "--out", "run/step_000002", "--no-progress"),
    r"a checkpoint")
add("resume-no-optimizer", ("pretrain", *C, "--set", "train.steps=3", "--resume", "--out", "run", "--no-progress"),
    r"has no optimizer\.pt: it cannot be continued exactly", remove("run/step_000002/optimizer.pt"))
add("resume-no-rng", ("pretrain", *C, "--set", "train.steps=3", "--resume", "--out", "run", "--no-progress"),
    r"has no rng\.pt", remove("run/step_000002/rng.pt"))
add("resume-no-state", ("pretrain", *C, "--set", "train.steps=3", "--resume", "--out", "run", "--no-progress"),
    r"has no state\.json", remove("run/step_000002/state.json"))
add("resume-damaged-optimizer", ("pretrain", *C, "--set", "train.steps=3", "--resume", "--out", "run", "--no-progress"),
    r"optimizer\.pt: damaged or not an lmforge file", write("run/step_000002/optimizer.pt", b"\x80\x02garbage"))
add("resume-truncated-optimizer", ("pretrain", *C, "--set", "train.steps=3", "--resume", "--out", "run",
                                   "--no-progress"), r"optimizer\.pt: damaged", truncate("run/step_000002/optimizer.pt", 100))
add("resume-damaged-rng", ("pretrain", *C, "--set", "train.steps=3", "--resume", "--out", "run", "--no-progress"),
    r"rng\.pt: damaged", write("run/step_000002/rng.pt", b"not a torch file"))
add("resume-state-no-data", ("pretrain", *C, "--set", "train.steps=3", "--resume", "--out", "run", "--no-progress"),
    r"state\.json: expected an object with integer `step`, `tokens` and a `data` object",
    edit_json("run/step_000002/state.json", lambda s: s.pop("data")))
add("resume-state-not-json", ("pretrain", *C, "--set", "train.steps=3", "--resume", "--out", "run", "--no-progress"),
    r"state\.json: not readable JSON", write("run/step_000002/state.json", "{step: 2"))
add("resume-state-list", ("pretrain", *C, "--set", "train.steps=3", "--resume", "--out", "run", "--no-progress"),
    r"state\.json: expected an object", write("run/step_000002/state.json", "[1, 2, 3]"))
add("resume-other-model", ("pretrain", *C, "--set", "model.dim=64", "--set", "train.steps=3", "--resume", "--out", "run",
                           "--no-progress"), r"different \[model\] section")
add("resume-sft-other-init", ("sft", *C, *SFT_SETS, "--set", "sft.init=run/step_000001", "--set", "sft.steps=2",
                              "--resume", "--out", "sft", "--no-progress"), r"sft\.init")

# 5. corpora (data.source) for prepare and train-tokenizer
CORPORA = [
    ("jsonl-invalid", "c.jsonl", '{"text": "a"}\n{"text": \n', r"c\.jsonl:2: not valid JSON"),
    ("jsonl-surrogate", "c.jsonl", '{"text": "ok"}\n{"text": "bad \\ud800 here"}\n', r"c\.jsonl:2: \"text\" holds a character that is not valid Unicode"),
    ("jsonl-not-object", "c.jsonl", '["text"]\n', r"c\.jsonl:1: expected an object with a string \"text\" field"),
    ("jsonl-text-number", "c.jsonl", '{"text": 3}\n', r"c\.jsonl:1: expected an object with a string \"text\" field"),
    ("jsonl-deep", "c.jsonl", '{"text": ' + "[" * 100000 + "]" * 100000 + "}\n", r"c\.jsonl:1: JSON nested too deeply|c\.jsonl:1: expected"),
    ("jsonl-bad-utf8", "c.jsonl", b'{"text": "\xff\xfe"}\n', r"c\.jsonl:1: not valid JSON"),
    ("jsonl-empty", "c.jsonl", "", r"yielded no documents"),
    ("parquet-garbage", "c.parquet", b"PAR1 this is not parquet PAR1", r"c\.parquet: not a readable Parquet file"),
    ("suffix", "c.csv", "text\nhello\n", r"unsupported file type '\.csv'"),
    ("missing", "absent.jsonl", None, r"absent\.jsonl.* does not exist"),
    ("folder-empty", "emptydir/", None, r"holds no \.txt/\.md/\.py files"),
]
for rid, rel, content, m in CORPORA:
    damage = None if content is None else write(rel, content)
    if rel.endswith("/"):
        damage = lambda p, rel=rel: (p / rel).mkdir()  # noqa: E731
    for cmd in (PREPARE, TOKENIZE):
        add(f"corpus-{cmd[0]}-{rid}", (*cmd[:1], "--set", f"data.source={rel.rstrip('/')}", *cmd[1:]), m, damage)
add("corpus-parquet-truncated", (*PREPARE[:1], "--set", "data.source=c.parquet", *PREPARE[1:]),
    r"c\.parquet: (not a readable Parquet file|damaged)",
    both(parquet("c.parquet", {"text": [f"document {i} " * 20 for i in range(2000)]}), truncate("c.parquet", 3000)))
add("corpus-parquet-wrong-type", (*PREPARE[:1], "--set", "data.source=c.parquet", *PREPARE[1:]),
    r"c\.parquet row 1: expected an object with a string \"text\" field", parquet("c.parquet", {"text": [1, 2, 3]}))
add("corpus-parquet-no-column", (*PREPARE[:1], "--set", "data.source=c.parquet", *PREPARE[1:]),
    r"c\.parquet: no 'text' column", parquet("c.parquet", {"body": ["a", "b"]}))
add("corpus-file-not-utf8-error", (*PREPARE[:1], "--set", "data.on_bad_utf8=error", *PREPARE[1:]),
    r"is not UTF-8", write("corpus/zz_latin1.py", b"caf\xe9 = 1\n"))

# 6. SFT data
SFT_DATA = [
    ("invalid-json", '{"messages": [\n', r"bad\.jsonl:1: not valid JSON"),
    ("unknown-role", json.dumps({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}),
     r"bad\.jsonl:1: message 0 has role 'robot'"),
    ("empty-messages", json.dumps({"messages": []}), r"bad\.jsonl:1: \"messages\" must be a non-empty list"),
    ("content-number", json.dumps({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]}),
     r"bad\.jsonl:1: message 0 \(user\) content is 5; expected a string"),
    ("ends-on-user", json.dumps({"messages": [{"role": "user", "content": "x"}]}), r"ends on a 'user' turn"),
    ("surrogate", '{"messages": [{"role": "user", "content": "\\udc80"}, {"role": "assistant", "content": "y"}]}',
     r"bad\.jsonl:1: message 0 \(user\) content holds a character that is not valid Unicode"),
    ("not-object", "[1, 2]", r"bad\.jsonl:1: expected a JSON object"),
    ("unknown-shape", json.dumps({"prompt": "x", "completion": "y"}), r"unknown record shape with keys"),
    ("sharegpt-from", json.dumps({"conversations": [{"from": "bot", "value": "x"}]}), r"turn 0 has \"from\" = 'bot'"),
    ("alpaca-output", json.dumps({"instruction": "x", "output": None}), r"Alpaca field \"output\" is None"),
    ("deep", '{"messages": ' + "[" * 100000 + "]" * 100000 + "}", r"bad\.jsonl:1: (JSON nested too deeply|message 0)"),
    ("empty-file", "", r"holds no conversations"),
]
for rid, text, m in SFT_DATA:
    add(f"sftdata-{rid}", ("sft", *C, *SFT_SETS, "--set", "sft.data=bad.jsonl", "--out", "newsft", "--no-progress"), m,
        write("bad.jsonl", text + ("\n" if text else "")))
add("sftdata-missing", ("sft", *C, *SFT_SETS, "--set", "sft.data=nope.jsonl", "--out", "newsft", "--no-progress"),
    r"sft\.data = 'nope\.jsonl' does not exist")
add("sftdata-parquet-garbage", ("sft", *C, *SFT_SETS, "--set", "sft.data=bad.parquet", "--out", "newsft", "--no-progress"),
    r"bad\.parquet: not a readable Parquet file", write("bad.parquet", b"PAR1xxxxPAR1"))
add("sft-init-empty", ("sft", *C, "--set", "sft.data=chat.jsonl", "--out", "newsft", "--no-progress"), r"sft\.init is empty")
add("sft-init-not-checkpoint", ("sft", *C, *SFT_SETS, "--set", "sft.init=data", "--out", "newsft", "--no-progress"),
    r"data is not a checkpoint")

# 7. checkpoints: every reader of one (generate, chat, eval, export, sft.init)
READERS = {"generate": GENERATE, "eval": EVAL, "export": EXPORT, "chat": CHAT}
CKPT_DAMAGE = [
    ("nan-weights", nan_weights("{ck}/model.safetensors"), r"NaN or infinite values"),
    ("truncated-weights", truncate("{ck}/model.safetensors", 200), r"cannot read weights"),
    ("garbage-weights", write("{ck}/model.safetensors", b"\x00" * 64), r"cannot read weights"),
    ("pad-edited", edit_json("{ck}/contract.json", lambda c: c["special_tokens"].update(pad=9)),
     r"contract|special|pad"),
    ("contract-not-json", write("{ck}/contract.json", "{"), r"contract\.json"),
    ("contract-list", write("{ck}/contract.json", "[]"), r"contract\.json"),
    ("config-not-utf8", write("{ck}/config.toml", b"\xff\xfe[model]\n"), r"config\.toml"),
    ("config-missing", remove("{ck}/config.toml"), r"has no config\.toml"),
    ("tokenizer-broken", write("{ck}/tokenizer.json", "{"), r"tokenizer\.json"),
    ("config-other-model", write("{ck}/config.toml", "[data]\nseq_len = 64\n[model]\ndim = 64\nn_heads = 4\n"
                                 "n_kv_heads = 2\nmax_seq_len = 128\n"), r"weights do not match|shape"),
]
for rname, argv in READERS.items():
    for rid, damage, m in CKPT_DAMAGE:
        ck = "sft/step_000001" if rname == "chat" else "run/step_000002"
        add(f"ckpt-{rname}-{rid}", argv, m, lambda p, d=damage, ck=ck: d(_Ck(p, ck)))

# 8. data folders and tokenizer folders
add("data-meta-broken", PRETRAIN, r"meta\.json", write("data/meta.json", "{"))
add("data-idx-truncated", PRETRAIN, r"train\.idx", truncate("data/train.idx", 12))
add("data-bin-missing", PRETRAIN, r"train\.bin", remove("data/train.bin"))
add("data-contract-missing", PRETRAIN, r"contract", remove("data/contract.json"))
add("data-missing", ("pretrain", *C, "--set", "data.dir=nodata", "--out", "newrun", "--no-progress"), r"lmforge prepare")
add("eval-data-broken", (*EVAL, "--data", "data"), r"meta\.json", write("data/meta.json", "[]"))
add("tok-json-broken", PREPARE, r"tokenizer\.json", write("tok/tokenizer.json", "{"))
add("tok-config-list", PREPARE, r"tokenizer_config\.json", write("tok/tokenizer_config.json", "[1]"))
add("tok-missing", ("prepare", *C, "--set", "tokenizer.dir=notok", "--out", "newdata"), r"notok")

# 9. Hugging Face folders of any shape (import-hf, import-tokenizer)
HF_DAMAGE = [
    ("config-list", write("hf/config.json", "[1, 2]"), r"config\.json"),
    ("config-not-json", write("hf/config.json", "{"), r"config\.json: not valid JSON"),
    ("config-no-arch", edit_json("hf/config.json", lambda c: c.pop("architectures")), r"config\.json"),
    ("config-gpt2", edit_json("hf/config.json", lambda c: c.update(architectures=["GPT2LMHeadModel"],
                                                                     model_type="gpt2")), r"GPT2|gpt2|Llama"),
    ("config-bias", edit_json("hf/config.json", lambda c: c.update(attention_bias=True)), r"bias"),
    ("config-str-dim", edit_json("hf/config.json", lambda c: c.update(hidden_size="64")), r"hidden_size"),
    ("config-nested", edit_json("hf/config.json", lambda c: c.update(num_hidden_layers={"a": [1]})),
     r"num_hidden_layers"),
    ("config-rope-scaling", edit_json("hf/config.json", lambda c: c.update(rope_scaling={"type": "linear",
                                                                                           "factor": 2.0})),
     r"rope_scaling"),
    ("weights-missing", remove("hf/model.safetensors"), r"has no model\.safetensors"),
    ("weights-garbage", write("hf/model.safetensors", b"garbage"), r"cannot read the weights"),
    ("tokenizer-missing", remove("hf/tokenizer.json"), r"tokenizer\.json"),
    ("tokenizer-broken", write("hf/tokenizer.json", "{"), r"tokenizer\.json"),
]
for rid, damage, m in HF_DAMAGE:
    add(f"importhf-{rid}", IMPORT_HF, m, damage)
for rid, damage, m in HF_DAMAGE[-2:]:
    add(f"importtok-{rid}", IMPORT_TOK, m, damage)
add("importtok-config-broken", IMPORT_TOK, r"tokenizer_config\.json", write("hf/tokenizer_config.json", "{"))
add("importhf-missing-folder", ("import-hf", "nothere", "--out", "newimp"), r"nothere")

# 10. GGUF export
GGUF = ("export", "--checkpoint", "run", "--format", "gguf", "--out", "model.gguf")
add("gguf-out-existing-file", (*GGUF[:-1], "notes.txt"), r"notes\.txt already exists.*--force")
add("gguf-out-folder", (*GGUF[:-1], "mine"), r"mine is a folder")
add("gguf-out-parent-is-file", (*GGUF[:-1], "notes.txt/model.gguf"), r"cannot be (written|created)")
add("gguf-out-name-too-long", (*GGUF[:-1], "m" * 300), r"cannot be written \(File name too long\)")
add("gguf-verify", (*GGUF, "--verify"), r"--verify compares with transformers")
add("gguf-nan-weights", GGUF, r"NaN or infinite", nan_weights("run/step_000002/model.safetensors"))
add("gguf-pad-edited", GGUF, r"contract|special|pad",
    edit_json("run/step_000002/contract.json", lambda c: c["special_tokens"].update(pad=9)))
add("import-gguf-not-gguf", ("import-gguf", "notes.txt", "--out", "newimp"), r"notes\.txt: cannot read it as GGUF")
add("import-gguf-missing", ("import-gguf", "nope.gguf", "--out", "newimp"), r"nope\.gguf is not a file")
add("import-gguf-folder", ("import-gguf", "mine", "--out", "newimp"), r"mine is not a file")
add("hf-q8", (*EXPORT, "--dtype", "q8_0"), r"--dtype q8_0 is for --format gguf")

def retokenized(ckpt: str, fn: Callable) -> Callable[[Path], None]:
    """Edit a checkpoint's tokenizer.json and re-hash it into its contract: a consistent checkpoint
    whose tokenizer GGUF export must judge (tests/test_gguf_families.py has the full set)."""
    def f(p: Path) -> None:
        from lmforge.contract import file_sha256

        edit_json(f"{ckpt}/tokenizer.json", fn)(p)
        edit_json(f"{ckpt}/contract.json", lambda c: c.update(tokenizer_sha256=file_sha256(p / ckpt / "tokenizer.json")))(p)
    return f


add("gguf-tokenizer-normalizer", GGUF, r"normalizer = \{\"type\": \"NFKC\"\}.*does not normalize",
    retokenized("run/step_000002", lambda tj: tj.update(normalizer={"type": "NFKC"})))
add("gguf-tokenizer-whitespace-split", GGUF, r"pre_tokenizer = \{\"type\": \"WhitespaceSplit\"\}.*no byte-level",
    retokenized("run/step_000002", lambda tj: tj.update(pre_tokenizer={"type": "WhitespaceSplit"})))
add("gguf-tokenizer-lstrip", GGUF, r"added token '<\|im_end\|>' .* has lstrip = true",
    retokenized("run/step_000002", lambda tj: next(a for a in tj["added_tokens"]
                                                    if a["content"] == "<|im_end|>").update(lstrip=True)))

add("hf-force", (*EXPORT, "--force"), r"--force is for --format gguf")

# 11. serve: refused before it listens
SERVE = ("serve", *C, "--checkpoint", "sft", "--port", "0")
add("serve-port", (*SERVE[:-1], "70000"), r"--port = 70000: expected 0\.\.65535")
add("serve-max-batch", (*SERVE, "--max-batch", "0"), r"--max-batch = 0: expected a value >= 1")
add("serve-timeout", (*SERVE, "--timeout", "-1"), r"--timeout = -1\.0")
add("serve-not-checkpoint", ("serve", *C, "--checkpoint", "data", "--port", "0"), r"data is not a checkpoint")
add("serve-nan-weights", SERVE, r"NaN or infinite", nan_weights("sft/step_000001/model.safetensors"))
add("serve-other-tokenizer", (*SERVE, "--tokenizer", "hf"), r"tokenizer|contract")

# 12. found by a hunt beyond this table (2026-11-23): each was a traceback, a hang, or exit 0
def symlink(rel: str, target: str) -> Callable[[Path], None]:
    def f(p: Path) -> None:
        (p / rel).symlink_to(target)
    return f


RESUME3 = ("pretrain", *C, "--set", "train.steps=3", "--resume", "--out", "run", "--no-progress")
RESUME2 = ("pretrain", *C, "--resume", "--out", "run", "--no-progress")  # steps=3 would change the decay taken
add("hunt-seed-overflow", (*PRETRAIN, "--set", "train.seed=99999999999999999999"), r"train\.seed = 99999999999999999999")
add("hunt-generate-seed-overflow", (*GENERATE, "--seed", "99999999999999999999"), r"--seed: .*out of range")
add("hunt-dim-huge", (*PRETRAIN, "--dry-run", "--set", "model.dim=65536"), r"needs about .* GiB, more than")
add("hunt-layers-huge", (*PRETRAIN, "--set", "model.n_layers=1024", "--set", "model.dim=8192"),
    r"needs about .* GiB, more than")
add("hunt-batch-huge", (*PRETRAIN, "--set", "train.micro_batch_size=1000000"), r"tokens per micro-batch\) needs")
add("hunt-maxseq-huge", (*PRETRAIN, "--set", "model.max_seq_len=1000000000000", "--set", "data.seq_len=64"),
    r"model\.max_seq_len = 1000000000000: expected 1 <= value <= 16777216")
add("hunt-vocab-huge", (*TOKENIZE[:1], "--set", "tokenizer.vocab_size=2000000000", *TOKENIZE[1:]),
    r"tokenizer\.vocab_size = 2000000000")
add("hunt-out-name-too-long", (*PREPARE[:-3], "--out", "x" * 300, "--no-progress"), r"cannot|too long|name")
add("hunt-out-parent-is-file", (*PREPARE[:-3], "--out", "notes.txt/sub", "--no-progress"),
    r"cannot be created|existing file")
add("hunt-lock-is-folder", PREPARE, r"lock path .* is a folder", lambda p: (p / ".newdata.lock").mkdir())
add("hunt-out-inside-tokenizer", (*PREPARE[:-3], "--out", "tok/sub", "--no-progress"), r"is inside .*tok.*tokenizer folder")
add("hunt-out-inside-checkpoint", ("pretrain", *C, "--out", "run/step_000002/sub", "--no-progress"),
    r"is inside .*a checkpoint")
add("hunt-export-inside-data", ("export", "--checkpoint", "run", "--out", "data/hf"), r"is inside .*prepared data folder")
add("hunt-import-inside-source", ("import-hf", "hf", "--out", "hf/imp"), r"is inside .*Hugging Face export folder")
add("hunt-eval-out-existing", (*EVAL, "--out", "notes.txt"), r"notes\.txt already exists.*--force")
add("hunt-eval-out-run-file", (*EVAL, "--out", "run/metrics.jsonl", "--force"), r"belongs to a pretraining run folder")
add("hunt-eval-out-inside-tok", (*EVAL, "--out", "tok/eval.json"), r"is inside .*tokenizer folder")
add("hunt-gguf-force-onto-tokenizer", (*GGUF[:-1], "tok/tokenizer.json", "--force"), r"is inside .*tokenizer folder")
add("hunt-gguf-dangling-link", GGUF, r"model\.gguf already exists", symlink("model.gguf", "nowhere.gguf"))
add("hunt-weights-are-a-folder", EVAL, r"model\.safetensors is not a regular file",
    both(remove("run/step_000002/model.safetensors"), lambda p: (p / "run/step_000002/model.safetensors").mkdir()))
add("hunt-prompt-not-utf8", (*GENERATE, "--prompt", "\udcff\udcfe"), r"--prompt: not UTF-8")
add("hunt-repetition-penalty-tiny", (*GENERATE, "--repetition-penalty", "1e-308"), r"generate\.repetition_penalty")
add("hunt-hf-bin-junk", IMPORT_HF, r"cannot read the weights",
    both(remove("hf/model.safetensors"), write("hf/pytorch_model.bin", b"\x80junk")))
add("hunt-state-step-negative", RESUME3, r"step = -1, but the folder is step_000002",
    edit_json("run/step_000002/state.json", lambda s: s.update(step=-1)))
add("hunt-state-step-bool", RESUME3, r"step = True", edit_json("run/step_000002/state.json", lambda s: s.update(step=True)))
add("hunt-state-step-past-steps", ("pretrain", *C, "--set", "train.steps=1", "--resume", "--out", "run",
                                   "--no-progress"), r"past train\.steps = 1")
add("hunt-state-tokens-negative", RESUME3, r"tokens = -5",
    edit_json("run/step_000002/state.json", lambda s: s.update(tokens=-5)))
add("hunt-state-epoch-negative", RESUME2, r"data position .*epoch = -1",
    edit_json("run/step_000002/state.json", lambda s: s["data"].update(epoch=-1)))
add("hunt-state-cursor-huge", RESUME2, r"data position .*cursor = 1000000000000",
    edit_json("run/step_000002/state.json", lambda s: s["data"].update(cursor=10**12)))
add("hunt-metrics-is-folder", RESUME3, r"metrics\.jsonl is not a regular file",
    both(remove("run/metrics.jsonl"), lambda p: (p / "run/metrics.jsonl").mkdir()))
add("hunt-step-entry-is-file", RESUME3, r"step_000003 is not a folder", write("run/step_000003", "a file"))
add("hunt-resume-other-seq-len", (*RESUME3, "--set", "data.seq_len=32"), r"data\.seq_len = 32 \(the run has 64\)")
add("hunt-resume-other-data", (*RESUME3, "--set", "data.dir=data2"), r"data\.dir = 'data2'",
    lambda p: shutil.copytree(p / "data", p / "data2"))
add("hunt-source-empty", (*PREPARE[:1], "--set", "data.source=", *PREPARE[1:]), r"data\.source is empty")
add("hunt-out-empty", ("prepare", *C, "--out", ""), r"--out: empty path")
add("hunt-user-file-in-own-output", ("prepare", *C, "--out", "data", "--no-progress"),
    r"also holds files lmforge did not write \(my_notes\.txt\)", write("data/my_notes.txt", "mine"))
add("hunt-copied-marker", ("prepare", *C, "--out", "mine", "--no-progress"), r"thesis\.tex",
    lambda p: shutil.copy(p / "data" / ".lmforge-output", p / "mine" / ".lmforge-output"))

add("hunt-marker-without-manifest", ("prepare", *C, "--out", "mine", "--no-progress"),
    r"without the list of the files it wrote", write("mine/.lmforge-output", '{"command": "prepare"}'))
add("hunt-huge-finite-weights", GENERATE, r"non-finite logits",
    lambda p: _scale_weights(p / "run/step_000002/model.safetensors", 1e30))


def _scale_weights(path: Path, factor: float) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    save_file({k: (v * factor if k.endswith("wq.weight") or k.startswith("output") or k.startswith("tok_") else v)
               for k, v in state.items()}, str(path))


# 13. generation inputs
add("generate-prompt-too-long", (*GENERATE[:-2], "--max-new-tokens", "4", "--prompt", "x " * 400),
    r"too long|max_seq_len|prompt")
add("generate-not-checkpoint", ("generate", *C, "--checkpoint", "data", "--prompt", "x"), r"data is not a checkpoint")
add("generate-other-tokenizer", (*GENERATE, "--tokenizer", "hf"), r"tokenizer|contract")
add("generate-temperature-flag", (*GENERATE, "--temperature", "-1"), r"generate\.temperature = -1\.0")
add("generate-topp-flag", (*GENERATE, "--top-p", "2"), r"generate\.top_p = 2\.0")


class _Ck:
    """A path-like view that fills the {ck} placeholder of a damage helper."""

    def __init__(self, root: Path, ck: str):
        self.root, self.ck = root, ck

    def __truediv__(self, rel: str) -> Path:
        return self.root / rel.format(ck=self.ck)


# -- the test ------------------------------------------------------------------------------------
@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_is_refused_cleanly(row: Row, project, tmp_path, monkeypatch, capsys):
    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    if row.damage is not None:
        row.damage(work)
    before = tree_hash(tmp_path)
    capsys.readouterr()
    try:
        rc = main(list(row.argv))
    except SystemExit as exc:  # argparse refuses a flag's value itself: usage + one error line, exit 2
        rc = exc.code
    out, err = capsys.readouterr()
    assert rc == 2, f"exit {rc}\n{err[-3000:]}"
    assert err.count("error:") == 1 and "Traceback" not in err, err[-3000:]
    line = err[err.index("error:"):]
    import re

    assert re.search(row.match, line, re.S), f"{row.match!r} not in {line!r}"
    assert tree_hash(tmp_path) == before, "files changed, appeared or vanished"


def test_the_table_is_large_and_covers_every_command():
    assert len(ROWS) >= 150, len(ROWS)
    commands = {r.argv[0] for r in ROWS}
    assert commands >= {"train-tokenizer", "import-tokenizer", "prepare", "pretrain", "sft", "generate", "chat",
                        "eval", "export", "import-hf", "import-gguf", "speedrun", "serve"}, commands
    assert len({r.id for r in ROWS}) == len(ROWS)
