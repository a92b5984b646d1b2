"""`lmforge speedrun` opens its output folder with the one run-folder opener of lmforge.fileio
(`open_run_dir`): another command's folder is refused, and an earlier speedrun that holds a
stage's output needs --resume; refused before any work, every file left as it was."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from lmforge.fileio import OutputError, read_marker, write_marker
from lmforge.stages.speedrun import SPEEDRUN_OUTPUT, speedrun_stage

from conftest import tiny_config


def tree_hash(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("marker, stage, match", [
    (SPEEDRUN_OUTPUT, "tokenizer", r"already holds a `lmforge speedrun` run .*Pass --resume"),
    ("prepare", None, r"prepare"),
])
def test_speedrun_output_is_opened_by_the_one_opener(tmp_path, marker, stage, match):
    out = tmp_path / "sp"
    out.mkdir()
    write_marker(out, marker)
    if stage:
        (out / stage).mkdir()
        (out / stage / "kept.txt").write_text("earlier work\n")
    before = tree_hash(tmp_path)
    with pytest.raises(OutputError, match=match):
        speedrun_stage(tiny_config(tmp_path / "cfg"), out, progress=False)
    assert tree_hash(tmp_path) == before


def test_a_speedrun_folder_without_stage_output_is_reopened(tmp_path, monkeypatch):
    """A folder the speedrun marked but no stage wrote into holds nothing to lose: reopened
    without --resume (the first stage then starts; stopped here by a stand-in)."""
    from lmforge.stages import speedrun as mod

    out = tmp_path / "sp"
    out.mkdir()
    write_marker(out, SPEEDRUN_OUTPUT)

    class Started(Exception):
        pass

    def first_stage(cfg, progress=True):
        raise Started

    monkeypatch.setattr(mod, "train_tokenizer_stage", first_stage)
    with pytest.raises(Started):
        speedrun_stage(tiny_config(tmp_path / "cfg"), out, progress=False)
    assert read_marker(out)["command"] == SPEEDRUN_OUTPUT
