"""Runs the commands of the README (and of docs/*.md) as written, in order, in a scratch folder.

The order is README.md's blocks, then each page of docs/ in name order (`readme_files`), all in
one folder: a page's commands may use what the README's made (runs/speedrun) and what an earlier
page made (docs/preference-tuning.md tunes docs/fine-tuning.md's runs/smol-sft);
tests/test_readme.py checks that no command reads a `runs/...` path only a later one makes.

`tests/test_readme.py` uses it; nothing here edits a command. A fenced block is run when one
of its commands starts with `lmforge` or `make`, or when a directive marks it; the smoke
configuration (a tiny model, a few steps) comes from the environment variable
`LMFORGE_CONFIG_OVERLAY` (lmforge.config.apply_overlay), which every command applies after its
own `--config` and `--set`.

Directives are HTML comments on the lines right before the fence (invisible when rendered):

    <!-- readme-test: key="value" key="value" -->

    skip="PREFIX" why="..."   commands that start with PREFIX are never run here (listed, with why)
    needs="PROG ..."          commands whose program is PROG run only where PROG is on PATH
                              (else listed as skipped: "needs PROG")
    fixture="PATH:KIND ..."   files the test makes before the block, standing in for the user's
                              own (KIND: hf-smollm2, hf-gemma3, chats, pairs, prompts, tasks, texts, parquet-shards,
                              jsonl-zst, web-jsonl, previous-block)
    background="PREFIX"       commands that start with PREFIX are servers: started in the
    ready="URL"               background, ready when URL answers 200, stopped (SIGINT) before
                              the next block that does not `use` them
    uses="PREFIX"             the block talks to that running server
    run="python"              a ```python block run with the interpreter running the tests
    expect="TEXT"             each command's standard output must contain TEXT

A ```sh block whose commands start with another program and that no directive marks is an
error: a command added to the README is run, or marked, never silently left out.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_PROGRAMS = ("lmforge", "make")
SHELL_LANGS = ("", "sh", "bash", "shell", "console")
DIRECTIVE = re.compile(r"^<!--\s*readme-test:(.*?)-->\s*$")
#: What the user types into an interactive command (`lmforge chat`): one turn, then end of input.
STDIN = "def add(a, b):\n"


class ReadmeError(Exception):
    """A block or a command of the README that the runner cannot take as written."""


@dataclass
class Command:
    text: str  # as written (continuations joined), for the shell
    program: str
    words: list[str]


@dataclass
class Block:
    source: str  # file:line of the opening fence
    lang: str
    body: str
    directives: dict[str, str]
    previous: str = ""  # the body of the fenced block before this one in the same file
    commands: list[Command] = field(default_factory=list)

    def prefixes(self, key: str) -> list[str]:
        return [self.directives[key]] if key in self.directives else []


@dataclass
class Outcome:
    source: str
    command: str
    status: str  # "passed", "failed", "skipped"
    why: str = ""
    seconds: float = 0.0


def parse_directives(lines: list[str], where: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in lines:
        m = DIRECTIVE.match(line.strip())
        if not m:
            continue
        try:
            words = shlex.split(m.group(1))
        except ValueError as exc:
            raise ReadmeError(f"{where}: directive {line.strip()!r}: {exc}") from None
        for w in words:
            key, eq, value = w.partition("=")
            if not eq or key not in ("skip", "why", "needs", "fixture", "background", "ready", "uses", "run",
                                     "expect"):
                raise ReadmeError(f"{where}: unknown directive {w!r} (see tests/readme_runner.py)")
            out[key] = value
    return out


def split_commands(body: str) -> list[Command]:
    """Shell lines with backslash continuations joined; blank and comment lines left out."""
    joined: list[str] = []
    buf = ""
    for line in body.splitlines():
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        joined.append(buf + line)
        buf = ""
    if buf:
        joined.append(buf)
    out = []
    for text in joined:
        words = shlex.split(text, comments=True)
        if words:
            out.append(Command(text.strip(), words[0], words))
    return out


def parse_blocks(path: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of a Markdown file that the runner runs (see the module docstring)."""
    text = path.read_text(encoding="utf-8") if text is None else text
    lines = text.splitlines()
    blocks: list[Block] = []
    previous = ""
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        body = "\n".join(lines[start + 1: j])
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{start + 1}"
        k = start - 1
        while k >= 0 and DIRECTIVE.match(lines[k].strip()):
            k -= 1
        directives = parse_directives(lines[k + 1: start], where)
        block = Block(where, lang, body, directives, previous)
        previous = body
        i = j + 1
        if lang == "python":
            if directives.get("run") == "python":
                blocks.append(block)
            continue
        if lang not in SHELL_LANGS:
            continue
        try:
            block.commands = split_commands(body)
        except ValueError:  # not shell (an output capture with an unbalanced quote)
            if lang in ("sh", "bash", "shell") or directives:
                raise ReadmeError(f"{where}: a shell block that does not parse as shell") from None
            continue
        runs = any(c.program in RUN_PROGRAMS for c in block.commands)
        if runs or directives:
            blocks.append(block)
        elif lang in ("sh", "bash", "shell") and block.commands:
            raise ReadmeError(f"{where}: a ```{lang} block starting with {block.commands[0].program!r}, which the "
                              f"README test neither runs nor skips: mark it with a readme-test directive")
    return blocks


def readme_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


# -- what the text promises -------------------------------------------------------------------------
#: Files each command promises in its --out folder (README "Commands" table and "A run folder holds").
RUN_FILES = ("metrics.jsonl", "config.toml", "contract.json", "tokenizer.json", "tokenizer_config.json",
             "plan.json")
PROMISES = {
    "train-tokenizer": ("tokenizer.json", "tokenizer_config.json", "contract.json", "report.json"),
    "prepare": ("train.bin", "train.idx", "contract.json", "meta.json", "report.json"),
    "pretrain": RUN_FILES, "sft": RUN_FILES, "dpo": RUN_FILES + ("dpo_data.json",), "rl": RUN_FILES + ("rl_data.json",),
    "import-hf": ("model.safetensors", "contract.json", "tokenizer.json", "config.toml"),
    "import-gguf": ("model.safetensors", "contract.json", "tokenizer.json", "config.toml"),
    "speedrun": ("summary.md", "summary.json", "loss.png", "sft_samples.json", "tokenizer/report.json",
                 "data/report.json", "pretrain/metrics.jsonl", "sft/metrics.jsonl"),
}
EXPORT_PROMISES = {
    "hf": ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"),
    "peft": ("adapter_model.safetensors", "adapter_config.json"),
}


def option(words: list[str], name: str, default: str | None = None) -> str | None:
    for i, w in enumerate(words):
        if w == name and i + 1 < len(words):
            return words[i + 1]
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    return default


def missing_promises(cmd: Command, cwd: Path) -> list[str]:
    """The files `cmd` promised that are not there after it finished."""
    w = cmd.words
    if cmd.program == "make" and "speedrun" in w:
        out, sub = cwd / "runs/speedrun", "speedrun"
    elif cmd.program == "lmforge" and len(w) > 1:
        sub, out = w[1], option(w, "--out")
        out = cwd / out if out else None
    else:
        return []
    if out is None:
        return []
    if not out.exists():
        return [str(out)]
    if sub == "export":
        fmt = option(w, "--format", "hf")
        if fmt == "gguf":
            return [] if out.read_bytes()[:4] == b"GGUF" else [f"{out} (not a GGUF file)"]
        names = EXPORT_PROMISES.get(fmt, ())
    elif sub == "prepare" and any("data.sources=" in x for x in w):  # a mixture: one prepared folder a source
        names = ("mixture.json", "contract.json", "config.toml")
    else:
        names = PROMISES.get(sub, ())
    gone = [str(out / n) for n in names if not (out / n).exists()]
    if sub in ("pretrain", "sft", "dpo", "rl", "speedrun") and not any(out.glob("step_*" if sub != "speedrun" else
                                                                            "pretrain/step_*")):
        gone.append(f"{out}/step_NNNNNN")
    return gone


def prose_paths(text: str) -> list[str]:
    """`runs/...` paths the README's prose (outside fenced blocks) names, placeholders as globs."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found = []
    for m in re.finditer(r"\bruns/[A-Za-z0-9_./-]*", prose):
        p = m.group(0).rstrip(".")
        p = p.replace("NNNNNN", "*")
        if p in ("runs/", "runs") or re.search(r"[A-Z]{3,}", p):
            continue
        found.append(p.rstrip("/"))
    return sorted(set(found))


# -- fixtures: the user's own files -----------------------------------------------------------------
def note_texts(n: int = 150) -> list[str]:
    """The text of a user's corpus fixture: `n` notes of 40 to 40 + n - 1 words."""
    words = "the model reads text and learns to predict the next token of each document".split()
    return [" ".join(words[(i + k) % len(words)] for k in range(40 + i)) + "\n" for i in range(n)]


def make_fixture(kind: str, path: Path, block: Block) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "hf-smollm2":  # a folder transformers saves: SmolLM2's layout, tokenizer and template
        sys.path.insert(0, str(ROOT / "tests"))
        from hf_families import build_folder

        build_folder("smollm", path, max_position_embeddings=2048)
    elif kind == "hf-gemma3":  # a folder transformers saves: Gemma 3's text model, tokenizer and template
        sys.path.insert(0, str(ROOT / "tests"))
        from hf_families import build_folder

        # the smoke overlay's 2 layers and 4/2 heads (it applies to the imported config too), both
        # sliding as llama.cpp's gemma3 pattern has them, and llama.cpp's attention scale (1/sqrt(head_dim))
        build_folder("gemma3", path, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     layer_types=["sliding_attention"] * 2, query_pre_attn_scalar=48)
    elif kind == "chats":
        rows = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                              {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
                for a in range(8) for b in range(6)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif kind == "pairs":
        rows = [{"prompt": f"What is {a} times {b}?", "chosen": f"{a * b}.", "rejected": f"{a * b + 1}."}
                for a in range(2, 9) for b in range(2, 8)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif kind == "prompts":
        rows = [{"prompt": f"What is {a} times {b}? Answer with the number.", "answer": str(a * b)}
                for a in range(2, 9) for b in range(2, 8)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif kind == "tasks":
        rows = [{"query": f"{a} + {b} =", "choices": [f" {a + b + d}" for d in (0, 1, 2, 3)], "gold": 0}
                for a in range(1, 7) for b in range(1, 5)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif kind == "texts":
        path.mkdir(parents=True, exist_ok=True)
        for i, body in enumerate(note_texts()):
            (path / f"note_{i:02d}.txt").write_text(body, encoding="utf-8")
    elif kind in ("parquet-shards", "jsonl-zst"):  # the same notes as the field ships them
        bodies = note_texts()
        if kind == "parquet-shards":
            import pyarrow as pa
            import pyarrow.parquet as pq

            path.mkdir(parents=True, exist_ok=True)
            for n in range(3):
                part = bodies[n * 50:(n + 1) * 50]
                pq.write_table(pa.table({"id": list(range(n * 50, n * 50 + len(part))), "content": part}),
                               path / f"part-{n:05d}.parquet")
        else:
            import zstandard

            raw = "".join(json.dumps({"text": b}) + "\n" for b in bodies).encode("utf-8")
            path.write_bytes(zstandard.ZstdCompressor().compress(raw))
    elif kind == "web-jsonl":  # crawled prose: pages, near-copies of some, boilerplate the filters reject
        import random

        rng = random.Random(0)
        words = ("the of and to in that is was for it with as on be at by had are but from or have an they which one "
                 "you were all there would their we been has when who will more if out so said what up about into "
                 "than them can only other new some could time these two may then first any now such like over even "
                 "most made after also did many before must through back years where much way well down should "
                 "because each just those people how little state good very make world still own see work long "
                 "river garden winter letter music window market island doctor engine forest harbor").split()
        pages = ["\n".join(" ".join(" ".join(rng.choice(words) for _ in range(rng.randint(8, 14))).capitalize() + "."
                                    for _ in range(3)) for _ in range(4)) for _ in range(300)]
        pages += [p.replace(" the ", " a ", 1) for p in pages[:30:3]]  # near-copies
        pages += ["Subscribe to our newsletter\n" * 20, "\n".join(" ".join(rng.choice(words) for _ in range(5))
                                                               for _ in range(30))] * 3
        path.write_text("".join(json.dumps({"text": p}) + "\n" for p in pages), encoding="utf-8")
    elif kind == "previous-block":
        path.write_text(block.previous + "\n", encoding="utf-8")
    else:
        raise ReadmeError(f"{block.source}: unknown fixture kind {kind!r}")


# -- running ------------------------------------------------------------------------------------------
def scratch_folder(cwd: Path) -> None:
    """`make` targets need the Makefile, the recipe and the environment where the user types them."""
    for name in ("Makefile", "configs", ".venv", "pyproject.toml"):
        if (ROOT / name).exists() and not (cwd / name).exists():
            (cwd / name).symlink_to(ROOT / name)


def environment(overlay: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if overlay is not None:
        env["LMFORGE_CONFIG_OVERLAY"] = str(overlay)
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float = 120.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc.poll() is not None:
            raise ReadmeError(f"the server exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise ReadmeError(f"{url} did not answer within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def skip_reason(block: Block, cmd: Command, path: str) -> str | None:
    """Why `cmd` is not run here (a `skip` directive, or a `needs` program not on `path`), or None.

    Raises:
        ReadmeError: a program the runner does not run and no directive names.
    """
    d = block.directives
    needs = d.get("needs", "").split()
    if d.get("skip") and cmd.text.startswith(d["skip"]):
        return d.get("why", "marked skip")
    if cmd.program in needs and shutil.which(cmd.program, path=path) is None:
        return f"needs {cmd.program} (not on PATH)"
    if cmd.program not in RUN_PROGRAMS and cmd.program not in needs and "uses" not in d:
        raise ReadmeError(f"{block.source}: {cmd.program!r} is neither run by the README test nor marked "
                          f"(needs=...): {cmd.text}")
    return None


def run_readme(blocks: list[Block], cwd: Path, overlay: Path | None, timeout_s: float = 600.0,
               log=print) -> list[Outcome]:
    """Run `blocks` in order in `cwd`; return one Outcome per command (and per python block).
    Stops at the first failure (later commands depend on earlier ones)."""
    scratch_folder(cwd)
    env = environment(overlay)
    outcomes: list[Outcome] = []
    servers: dict[str, subprocess.Popen] = {}
    logs = cwd / "readme-test-logs"
    logs.mkdir(exist_ok=True)
    try:
        for block in blocks:
            d = block.directives
            for prefix in list(servers):
                if d.get("uses") != prefix:
                    stop(servers.pop(prefix))
            for item in d.get("fixture", "").split():
                rel, _, kind = item.rpartition(":")
                if not (cwd / rel).exists():
                    make_fixture(kind, cwd / rel, block)
            if block.lang == "python":
                if d.get("uses") and d["uses"] not in servers:
                    outcomes.append(Outcome(block.source, "python block", "skipped", f"{d['uses']} is not running"))
                    continue
                t0 = time.time()
                r = subprocess.run([sys.executable, "-c", block.body], cwd=cwd, env=env, capture_output=True,
                                   text=True, timeout=timeout_s)
                ok = r.returncode == 0
                outcomes.append(Outcome(block.source, "python block", "passed" if ok else "failed",
                                        "" if ok else f"exit {r.returncode}: {r.stderr[-2000:]}", time.time() - t0))
                if not ok:
                    return outcomes
                continue
            for cmd in block.commands:
                shown = re.sub(r"\s{2,}#.*$", "", cmd.text)
                shown = shown if len(shown) < 110 else shown[:107] + "..."
                why = skip_reason(block, cmd, env["PATH"])
                if why:
                    outcomes.append(Outcome(block.source, shown, "skipped", why))
                    continue
                if d.get("uses") and d["uses"] not in servers:
                    outcomes.append(Outcome(block.source, shown, "skipped", f"{d['uses']} is not running"))
                    continue
                log(f"readme: {block.source}: {cmd.text}")
                t0 = time.time()
                out_log = logs / f"{len(outcomes):02d}.log"
                if d.get("background") and cmd.text.startswith(d["background"]):
                    f = out_log.open("w")
                    proc = subprocess.Popen(["bash", "-c", cmd.text], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                            stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
                    servers[d["background"]] = proc
                    try:
                        wait_ready(proc, d.get("ready", ""))
                    except ReadmeError as exc:
                        stop(proc)
                        outcomes.append(Outcome(block.source, shown, "failed", f"{exc}; output: "
                                                f"{out_log.read_text()[-2000:]}", time.time() - t0))
                        return outcomes
                    outcomes.append(Outcome(block.source, shown, "passed", "serving", time.time() - t0))
                    continue
                r = subprocess.run(["bash", "-c", cmd.text], cwd=cwd, env=env, input=STDIN, capture_output=True,
                                   text=True, timeout=timeout_s)
                out_log.write_text(r.stdout + r.stderr)
                why = ""
                if r.returncode != 0:
                    why = f"exit {r.returncode}: {(r.stderr or r.stdout)[-2500:]}"
                elif d.get("expect") and d["expect"] not in r.stdout:
                    why = f"its output lacks {d['expect']!r}: {r.stdout[-1000:]}"
                else:
                    gone = missing_promises(cmd, cwd)
                    if gone:
                        why = f"exit 0 but missing: {', '.join(gone)}"
                outcomes.append(Outcome(block.source, shown, "failed" if why else "passed", why, time.time() - t0))
                if why:
                    return outcomes
    finally:
        for proc in servers.values():
            stop(proc)
    return outcomes


def table(outcomes: list[Outcome]) -> str:
    rows = [f"| {o.source} | `{o.command}` | {o.status}{' (' + o.why.splitlines()[0][:160] + ')' if o.why else ''} "
            f"| {o.seconds:.1f} s |" for o in outcomes]
    return "\n".join(["| where | command | status | time |", "|---|---|---|---|", *rows])
