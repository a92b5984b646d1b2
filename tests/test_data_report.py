"""The data report of `prepare` (report.json in the data folder): lengths and shares
recomputed from the shards, exact and near-duplicates found where they were planted (within
train and between train and held-out), unrelated documents not flagged."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from conftest import tiny_config
from lmforge.data.reports import DataReport, data_report_lines
from lmforge.data.sources import split_of


def words(rng, n):
    vocab = ["alpha", "beta", "gamma", "delta", "value", "items", "count", "total", "index", "name", "data",
             "result", "x", "y", "z", "key", "node", "tree", "list", "map"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def name_in(split, prefix, val_fraction=0.2):
    i = 0
    while split_of(f"{prefix}{i}.py", val_fraction) != split:
        i += 1
    return f"{prefix}{i}.py"


@pytest.fixture
def corpus(tmp_path):
    rng = random.Random(0)
    folder = tmp_path / "corpus"
    folder.mkdir()
    docs = {}
    for i in range(40):
        docs[f"doc{i:02d}.py"] = words(rng, rng.randint(20, 400)) + "\n"
    base = words(rng, 300)
    near = base.split()
    near[150] = "changed"  # one word of 300: a near-duplicate
    a, b = name_in("train", "near_a"), name_in("train", "near_b")
    docs[a], docs[b] = base + "\n", " ".join(near) + "\n"
    leak = words(rng, 300)
    leak2 = leak.split()
    leak2[10] = "other"
    t, v = name_in("train", "leak_t"), name_in("val", "leak_v")
    docs[t], docs[v] = leak + "\n", " ".join(leak2) + "\n"
    docs["copy_of_doc00.py"] = docs["doc00.py"]  # an exact duplicate
    for name, text in docs.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder, (a, b), (t, v)


def test_prepare_reports_lengths_and_duplicates(tmp_path, corpus, tiny_tokenizer):
    from lmforge.stages import prepare_stage

    folder, (a, b), (t, v) = corpus
    cfg = tiny_config(tmp_path, folder, **{"tokenizer.dir": str(tiny_tokenizer.folder)})
    meta = prepare_stage(cfg, progress=False)
    report = json.loads((tmp_path / "data" / "report.json").read_text())
    assert report == json.loads(json.dumps(meta["report"]))
    for split in ("train", "val"):
        idx = np.fromfile(tmp_path / "data" / f"{split}.idx", dtype=np.int64)
        n = np.diff(idx)
        m = report["splits"][split]
        assert m["documents"] == len(n) and m["tokens"] == int(n.sum())
        q = m["length_tokens"]
        assert (q["min"], q["median"], q["max"]) == (int(n.min()), float(np.median(n)), int(n.max()))
        assert q["q1"] == pytest.approx(np.percentile(n, 25)) and q["q3"] == pytest.approx(np.percentile(n, 75))
        long = n[n > cfg.data.seq_len + 1].sum() / n.sum()
        assert m["share_of_tokens_in_documents_longer_than_seq_len"] == pytest.approx(long, abs=1e-4)
        assert m["bytes_per_token"] == pytest.approx(meta["splits"][split]["bytes"] / n.sum(), abs=1e-4)
    assert report["exact_duplicates_dropped"] == {"count": 1, "examples": [["copy_of_doc00.py", "doc00.py"]]} or \
        report["exact_duplicates_dropped"] == {"count": 1, "examples": [["doc00.py", "copy_of_doc00.py"]]}
    nd = report["near_duplicates"]
    assert [sorted(p[:2]) for p in nd["within_train"]["examples"]] == [sorted([a, b])]
    assert [sorted(p[:2]) for p in nd["between_train_and_val"]["examples"]] == [sorted([t, v])]
    assert nd["within_val"]["pairs"] == 0
    assert report["largest_documents"][0]["tokens"] == max(
        report["splits"][s]["length_tokens"]["max"] for s in ("train", "val"))


def test_minhash_estimates_jaccard():
    """The signature agreement estimates the Jaccard similarity of the 5-gram sets."""
    rng = np.random.default_rng(1)
    r = DataReport()
    base = rng.integers(0, 1000, size=2000)
    other = base.copy()
    other[1000:] = rng.integers(0, 1000, size=1000)  # about half the 5-grams shared
    grams = lambda x: {tuple(x[i:i + 5]) for i in range(len(x) - 4)}  # noqa: E731
    jaccard = len(grams(base) & grams(other)) / len(grams(base) | grams(other))
    estimate = float((r.signature(base) == r.signature(other)).mean())
    assert abs(estimate - jaccard) < 0.15, (estimate, jaccard)
    assert float((r.signature(base) == r.signature(rng.integers(0, 1000, size=2000))).mean()) < 0.1


def test_signatures_are_capped_by_a_consistent_sample_that_keeps_near_duplicates_together():
    """D6: above `max_signatures` documents the report keeps a sample of signatures (the
    documents whose first MinHash value is a multiple of 2^k), says so, and still finds planted
    near-duplicates: a pair shares that value with probability ~ its similarity, so it stays in
    the sample together. Every pair found is a planted one; the same documents under no cap find
    at least 95% of the planted pairs."""
    rng = np.random.default_rng(7)
    docs, planted = [], set()
    for i in range(1000):
        docs.append(rng.integers(0, 5000, size=int(rng.integers(150, 300))))
        if i % 5 == 4:  # 200 planted near-duplicates: a copy with two tokens changed
            twin = docs[-1].copy()
            twin[[10, len(twin) // 2]] = rng.integers(5000, 6000, size=2)
            docs.append(twin)
            planted.add((len(docs) - 2, len(docs) - 1))

    def run(cap: int) -> tuple[DataReport, dict]:
        r = DataReport(max_signatures=cap)
        for i, ids in enumerate(docs):
            r.add(f"d{i}", "train", ids, len(ids) + 2, 4 * len(ids))
        return r, r.finish(seq_len=256)

    full, report = run(10_000)
    assert report["near_duplicates"]["sample"]["share"] == 1.0
    every = {(i, j) for i, j, _ in full.near_duplicates()}
    assert every <= planted and len(every) >= 0.95 * len(planted)  # MinHash estimates: a few fall under 0.8
    capped, report = run(100)
    sample = report["near_duplicates"]["sample"]
    assert len(capped.signatures) <= 100 and capped.sampling >= 3 and sample["share"] == 1 / 2 ** capped.sampling
    assert sample["documents"] == len(docs) and sample["with_signature"] == len(capped.signatures)
    found = {(i, j) for i, j, _ in capped.near_duplicates()}
    assert found and found <= every  # planted pairs found in the sample, nothing else
    assert report["near_duplicates"]["within_train"]["pairs"] == len(found)
    assert "counted on a sample of" in data_report_lines(report) and "capped at 100" in data_report_lines(report)
