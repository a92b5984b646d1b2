"""The tokenizer report (lmforge.data.reports) that train-tokenizer and import-tokenizer write
as report.json: every figure recomputed here independently, on a corpus with known kinds of
lines; the report moves into place with the tokenizer folder (a re-run replaces it)."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_config
from lmforge.data.reports import line_kind
from lmforge.data.sources import iter_documents


@pytest.mark.parametrize("line, kind", [
    ("\n", "whitespace"), ("    \t  \n", "whitespace"), ("x = f(a, b)  # ok\n", "code"),
    ("    # This function returns the value\n", "prose"), ("Return the number of items.\n", "prose"),
    ("café au lait\n", "non_ascii"), ("    return x[1:]\n", "code"), ("if a == b[0]:\n", "code"),
])
def test_line_kinds(line, kind):
    assert line_kind(line) == kind


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(30):
        (folder / f"doc_{i:02d}.py").write_text(
            f"def f{i}(x):\n    # Return the value of the item, doubled\n    return x * {i}\n\n"
            f"name = 'café {i}'\n", encoding="utf-8")
    return folder


def test_train_tokenizer_writes_a_report_whose_figures_are_recomputed(tmp_path, corpus):
    from lmforge.stages import train_tokenizer_stage
    from lmforge.tokenizer import Tokenizer

    cfg = tiny_config(tmp_path, corpus, **{"tokenizer.vocab_size": "320"})
    train_tokenizer_stage(cfg, progress=False)
    tok = Tokenizer.load(cfg.tokenizer.dir)
    report = json.loads((tok.folder / "report.json").read_text(encoding="utf-8"))
    texts = {s: [d.text for d in iter_documents(str(corpus), s, cfg.data.val_fraction)] for s in ("train", "val")}
    seen = set()
    for split, docs in texts.items():
        n_bytes = sum(len(t.encode()) for t in docs)
        ids = [tok.hf.encode(t, add_special_tokens=False).ids for t in docs]
        seen.update(i for x in ids for i in x)
        assert report["bytes_per_token"][split] == pytest.approx(n_bytes / sum(map(len, ids)), abs=1e-4)
    per = {k: [0, 0] for k in ("code", "prose", "whitespace", "non_ascii")}
    for t in texts["val"]:
        for line in t.splitlines(keepends=True):
            k = line_kind(line)
            per[k][0] += len(line.encode())
            per[k][1] += len(tok.hf.encode(line, add_special_tokens=False).ids)
    for k, (b, n) in per.items():
        assert n > 0 and report["bytes_per_token_by_kind"][k] == pytest.approx(b / n, abs=1e-4), k
    specials = set(tok.contract.special_tokens.values())
    assert report["tokens_unused"] == sum(1 for i in range(tok.vocab_size) if i not in seen and i not in specials)
    assert {k: v["id"] for k, v in report["special_tokens"].items()} == tok.contract.special_tokens
    longest = report["longest_tokens"][0]
    assert longest["bytes"] == max(len(tok.hf.decode([i]).encode()) for i in range(tok.vocab_size) if i not in specials)
    assert report["reference"]["available"] in (True, False)
    # the report is part of the folder lmforge wrote: a second run replaces the folder, report included
    train_tokenizer_stage(cfg, progress=False)
    assert json.loads((tok.folder / "report.json").read_text(encoding="utf-8"))["bytes_per_token"] == \
        report["bytes_per_token"]


def test_import_tokenizer_writes_a_report(tmp_path, corpus):
    from hf_families import build_tokenizer

    from lmforge.stages import import_tokenizer_stage

    build_tokenizer("smollm", tmp_path / "hf")
    cfg = tiny_config(tmp_path, corpus)
    tok = import_tokenizer_stage(cfg, tmp_path / "hf", tmp_path / "tok")
    report = json.loads((tok.folder / "report.json").read_text(encoding="utf-8"))
    assert report["vocab_size"] == tok.vocab_size and report["bytes_per_token"]["train"] > 1.0
    assert report["special_tokens"]["eos"]["text"] == "<|endoftext|>"
