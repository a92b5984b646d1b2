"""The README runs: every command of its shell blocks (and of docs/*.md), as written, in order
(README.md first, then the pages of docs/ in name order), in one scratch folder, on a tiny model
(tests/readme_smoke.toml through LMFORGE_CONFIG_OVERLAY). Each command must exit 0 and leave the
files the text promises; the `runs/...` paths the prose of the README and of its pages names
must exist at the end, and each `runs/...` a command reads is made by a command before it. Commands that need what this machine lacks (llama.cpp's programs,
Ollama) are marked in the README's source and listed as skipped; a command added to the README
later is run without anyone adding it here (tests/readme_runner.py says how blocks are read).
"""

from __future__ import annotations

import glob
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from readme_runner import (ROOT, Block, ReadmeError, environment, option, parse_blocks,  # noqa: E402
                           prose_paths, readme_files, run_readme, skip_reason, table)

OVERLAY = Path(__file__).parent / "readme_smoke.toml"
COMMENT = re.compile(r"\s{2,}#.*$")  # a trailing shell comment, as the README aligns them


def all_blocks() -> list[Block]:
    return [b for f in readme_files() for b in parse_blocks(f)]


@pytest.mark.slow
def test_every_readme_command_runs_and_leaves_what_it_promises(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("starlette")
    outcomes = run_readme(all_blocks(), tmp_path, OVERLAY, log=lambda line: None)
    print("\n" + table(outcomes))
    failed = [o for o in outcomes if o.status == "failed"]
    assert not failed, f"{failed[0].source}: `{failed[0].command}` failed: {failed[0].why}"
    ran = [o for o in outcomes if o.status == "passed"]
    assert len(ran) >= 20, table(outcomes)
    missing = [f"{f.relative_to(ROOT)}: {p}" for f in readme_files() for p in prose_paths(f.read_text(encoding="utf-8"))
               if not glob.glob(str(tmp_path / p))]
    assert not missing, f"the README (or its page) names these, but the commands it shows did not make them: {missing}"


#: what a command reads from an earlier one's output: these options, and these --set keys
READ_OPTIONS = ("--checkpoint", "--evaluation")
READ_KEYS = ("sft.init", "dpo.init", "rl.init", "train.init", "tokenizer.dir", "data.dir")


def unmade_inputs(blocks: list[Block]) -> list[str]:
    """Each `runs/...` a command of `blocks` reads (a checkpoint, an init, a tokenizer or data
    folder, an evaluation) that no command before it in the run order makes (`--out`, or
    `make speedrun`'s runs/speedrun): a page of docs/ moved or renamed so that it runs before the
    page whose outputs it uses."""
    made: list[str] = []
    out = []
    for b in blocks:
        for c in b.commands:
            w = c.words
            reads = [v for o in READ_OPTIONS if (v := option(w, o))]
            reads += [w[i + 1].partition("=")[2] for i, x in enumerate(w[:-1])
                      if x == "--set" and w[i + 1].partition("=")[0] in READ_KEYS]
            for r in reads:
                if r.startswith("runs/") and not any(r == m or r.startswith(m.rstrip("/") + "/") for m in made):
                    out.append(f"{b.source}: `{COMMENT.sub('', c.text)}` reads {r}, which no earlier command makes")
            if c.program == "make" and "speedrun" in w:
                made.append("runs/speedrun")
            if option(w, "--out"):
                made.append(option(w, "--out"))
    return out


def test_each_command_reads_only_what_an_earlier_command_made():
    """README.md runs first and docs/*.md in name order, in one folder: a page may use
    runs/speedrun and what an earlier page made (docs/preference-tuning.md tunes
    docs/fine-tuning.md's runs/smol-sft), never what a later one makes."""
    assert unmade_inputs(all_blocks()) == []
    late = parse_blocks(ROOT / "x.md", "```sh\nlmforge dpo --set dpo.init=runs/a-sft --out runs/b\n"
                                       "lmforge sft --set sft.init=runs/speedrun/pretrain --out runs/a-sft\n```\n")
    assert unmade_inputs(late) == ["x.md:1: `lmforge dpo --set dpo.init=runs/a-sft --out runs/b` reads runs/a-sft, "
                                   "which no earlier command makes",
                                   "x.md:1: `lmforge sft --set sft.init=runs/speedrun/pretrain --out runs/a-sft` reads "
                                   "runs/speedrun/pretrain, which no earlier command makes"]


def test_commands_that_need_what_is_missing_are_listed():
    """The README commands this machine does not run, each with why (a skip, not a pass)."""
    path = environment(None)["PATH"]
    skipped = [f"{b.source}: `{COMMENT.sub('', c.text)}`: {why}" for b in all_blocks() for c in b.commands
               if (why := skip_reason(b, c, path))]
    if skipped:
        pytest.skip("README commands not run here: " + "; ".join(skipped))


def test_a_broken_readme_command_fails_the_run(tmp_path):
    text = ("Intro.\n\n```sh\nlmforge train-tokenizer --set tokenizer.vocab_sise=300 --out runs/tok\n"
            "lmforge prepare --out runs/data\n```\n")
    blocks = parse_blocks(tmp_path / "README.md", text)
    assert [c.program for c in blocks[0].commands] == ["lmforge", "lmforge"]
    outcomes = run_readme(blocks, tmp_path, None, log=lambda line: None)
    assert [o.status for o in outcomes] == ["failed"]  # and the command after it is not run
    assert "exit 2" in outcomes[0].why and "tokenizer.vocab_sise" in outcomes[0].why


def test_a_command_that_exits_0_without_its_promised_files_fails(tmp_path):
    blocks = parse_blocks(tmp_path / "README.md", "```sh\nlmforge --help --out runs/nothing\n```\n")
    outcomes = run_readme(blocks, tmp_path, None, log=lambda line: None)
    assert outcomes[0].status == "failed" and "missing" in outcomes[0].why


def test_blocks_the_runner_would_leave_out_are_errors(tmp_path):
    with pytest.raises(ReadmeError, match="ollama"):  # another program, no directive
        parse_blocks(tmp_path / "README.md", "```sh\nollama run lmforge\n```\n")
    with pytest.raises(ReadmeError, match="unknown directive"):
        parse_blocks(tmp_path / "README.md", "<!-- readme-test: nedds=\"x\" -->\n```sh\nlmforge --help\n```\n")
    blocks = parse_blocks(tmp_path / "README.md", "<!-- readme-test: needs=\"llama-cli\" -->\n```sh\n"
                                                  "lmforge --help\nllama-cli -m x.gguf \\\n  -cnv   # chat\n```\n")
    (cmd_a, cmd_b) = blocks[0].commands
    assert cmd_b.words == ["llama-cli", "-m", "x.gguf", "-cnv"]
    empty = os.pathsep.join([str(tmp_path)])
    assert skip_reason(blocks[0], cmd_a, empty) is None
    assert skip_reason(blocks[0], cmd_b, empty) == "needs llama-cli (not on PATH)"


def test_every_command_of_the_readme_table_explains_itself(capsys):
    """`lmforge COMMAND --help` for every command the README's table lists."""
    from lmforge.cli import main

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = sorted(set(re.findall(r"^\| `lmforge ([a-z-]+)", text, flags=re.M)))
    assert len(commands) >= 14, commands
    for name in commands:
        with pytest.raises(SystemExit) as exc:
            main([name, "--help"])
        assert exc.value.code == 0, name
        assert "--config" in capsys.readouterr().out, name
