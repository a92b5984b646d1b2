"""The model card of an export (lmforge.export.card): the Hub's front matter and a body written
from the run folders (every stage of the chain, its data, steps and losses; the latest evaluation
suite recorded for the checkpoint), and the same facts in a GGUF's general.* keys."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lmforge.export import export_hf
from lmforge.export.card import training_chain
from lmforge.stages.pretrain import pretrain_stage


@pytest.fixture(scope="module")
def chain(tiny_run, tmp_path_factory):
    """A pretraining run, and a continued pretraining from it (train.init): two linked runs."""
    cfg, _ = tiny_run
    tmp = tmp_path_factory.mktemp("card")
    cfg = replace(cfg, train=replace(cfg.train, steps=2, eval_every=2))
    pretrain_stage(cfg, tmp / "base", progress=False)
    pretrain_stage(replace(cfg, train=replace(cfg.train, init=str(tmp / "base"))), tmp / "more", progress=False)
    return cfg, tmp


def test_the_chain_is_read_from_the_run_folders(chain):
    cfg, tmp = chain
    stages = training_chain(tmp / "more" / "step_000002")
    assert [s.command for s in stages] == ["pretrain", "pretrain"]
    assert [s.folder.name for s in stages] == ["base", "more"] and stages[1].init.endswith("base")
    assert all(s.steps == 2 and s.tokens and s.data == cfg.data.source for s in stages)
    rows = [json.loads(x) for x in (tmp / "more" / "metrics.jsonl").read_text().splitlines()]
    assert stages[1].loss == [r for r in rows if "loss" in r][-1]["loss"]


def test_the_hf_export_carries_a_card_with_the_evaluation(chain, tmp_path, capsys):
    from lmforge.cli import main
    from test_cli import one_error_line

    _, tmp = chain
    ckpt = tmp / "more" / "step_000002"
    results = {"checkpoint": str(ckpt), "seed": 0, "limit": 5, "suite": 0.25,
               "tasks": {"next_line": {"kind": "choice", "n": 5, "accuracy": 0.4, "accuracy_sum": 0.4, "baseline": 0.25,
                                       "centred": 0.2, "interval": [0.1, 0.8]}}}
    (tmp_path / "tasks.json").write_text(json.dumps(results))
    card = (export_hf(ckpt, tmp_path / "hf", evaluation=tmp_path / "tasks.json") / "README.md").read_text()
    front, body = card.split("\n---\n", 1)
    assert front.startswith("---\nlibrary_name: transformers\n") and "- lmforge" in front and "license" in front
    assert "| pretrain |" in body and body.count("| pretrain |") == 2
    assert "| next_line | choice | 5 | 40.0%" in body
    assert "base_model" not in front  # no imported model in the chain: nothing claimed
    plain = (export_hf(ckpt, tmp_path / "plain") / "README.md").read_text()
    assert "No evaluation suite was given" in plain
    (tmp_path / "other.json").write_text(json.dumps({**results, "checkpoint": str(tmp / "base" / "step_000002")}))
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "x"), "--evaluation",
                 str(tmp_path / "other.json")]) == 2
    assert "another model" in one_error_line(capsys) and not (tmp_path / "x").exists()
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "y.gguf"), "--format", "gguf",
                 "--evaluation", str(tmp_path / "tasks.json")]) == 2
    assert "--format hf" in one_error_line(capsys)


def test_the_gguf_carries_the_same_facts(chain, tmp_path):
    gguf = pytest.importorskip("gguf")
    from lmforge.export import export_gguf

    _, tmp = chain
    out = export_gguf(tmp / "more", tmp_path / "m.gguf")
    fields = gguf.GGUFReader(str(out)).fields
    text = lambda f: bytes(f.parts[f.data[0]]).decode()  # noqa: E731
    assert text(fields["general.description"]).startswith("lmforge: pretrain on ")
    assert "lmforge" in [bytes(fields["general.tags"].parts[i]).decode() for i in fields["general.tags"].data]
