"""`lmforge prepare` with datatrove's quality filters (data.filters) and MinHash deduplication
(data.dedup = "minhash"): the documents removed are those datatrove's filters reject and each
near-duplicate component but its first in the stream, recomputed here document by document; the
data folder is the same at 1, 2 and 3 tasks (one process for the filters alone at 1); bad
settings and a missing spaCy are a ConfigError, nothing written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("spacy")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_prepare_parallel import folder_digest, read_split  # noqa: E402

from lmforge.config import from_dict  # noqa: E402
from lmforge.data import parallel, stream_tasks  # noqa: E402
from lmforge.data.prepare import TASKS_SUFFIX, prepare  # noqa: E402
from lmforge.data.quality import DocFilters, Quality, near_duplicates, signature_step  # noqa: E402
from lmforge.data.sources import iter_documents, split_of  # noqa: E402
from lmforge.errors import ConfigError  # noqa: E402

WORDS = ("the of and to in that is was he for it with as his on be at by had are but from or have an they which one "
         "you were her all she there would their we him been has when who will more no if out so said what up its "
         "about into than them can only other new some could time these two may then do first any my now such like "
         "our over man me even most made after also did many before must through back years where much your way "
         "well down should because each just those people how too little state good very make world still own see "
         "men work long get here between both life being under never day same another know while last might great "
         "old year off come since against go came right used take three river garden winter letter music window "
         "market island doctor engine forest harbor silver paper").split()


def prose(rng) -> str:
    """English-looking prose: 12 sentences of 8 to 14 words, three to a line."""
    sentences = [" ".join(rng.choice(WORDS, size=int(rng.integers(8, 15)))).capitalize() + "." for _ in range(12)]
    return "\n".join(" ".join(sentences[i:i + 3]) for i in range(0, 12, 3))


def edited(text: str, rng, n: int = 2) -> str:
    """`text` with `n` of its words replaced: a near-duplicate (word 5-gram Jaccard about 0.85)."""
    words = text.split(" ")
    for i in rng.choice(len(words), size=n, replace=False):
        words[i] = str(rng.choice(WORDS)) + ("." if words[i].endswith(".") else "")
    return " ".join(words)


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """One JSONL file: 60 prose documents, then near-copies of 8 of them (far from their originals:
    in other tasks), documents the filters reject (repeated lines; lines without punctuation),
    exact duplicates; chunks of 3 records, so that 1, 2 and 3 tasks deal them differently."""
    monkeypatch.setattr(parallel, "MIN_TASK_BYTES", 1)
    monkeypatch.setattr(stream_tasks, "CHUNK_RECORDS", 3)
    rng = np.random.default_rng(5)
    base = [prose(rng) for _ in range(60)]
    near = {60 + k: i for k, i in enumerate((3, 7, 11, 20, 33, 41, 50, 58))}  # copy's line -> original's
    texts = base + [edited(base[i], rng) for i in near.values()]
    texts += [edited(base[3], rng, 3)]  # a copy of a copy's original: the same component
    near[len(texts) - 1] = 3
    junk = ["Buy now and save big today.\n" * 30, "\n".join(" ".join(rng.choice(WORDS, size=6)) for _ in range(40))]
    texts += junk + [base[5], junk[0], base[59]] + [prose(rng) for _ in range(20)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path, texts, near


def reference(source: Path, tok, val_fraction: float, quality: Quality) -> tuple[dict, dict]:
    """Recomputed document by document: datatrove's filters on each text (the first to reject it
    removes it), the first copy of each text, then near-duplicates — any of datatrove's 14 band
    signatures equal — joined into components, each kept as its first document. Returns the kept
    documents' tokens per split and what was removed."""
    filters = DocFilters(quality.filters) if quality.filters else None
    docs = list(iter_documents(str(source), None, val_fraction))
    seen, kept, removed = set(), [], {"filtered": [[] for _ in quality.filters], "exact": 0, "near": []}
    for doc in docs:
        verdict = filters.verdict(doc.text) if filters else 0
        if verdict:
            removed["filtered"][verdict - 1].append(doc)
        elif doc.text in seen:
            removed["exact"] += 1
        else:
            seen.add(doc.text)
            kept.append(doc)
    if quality.dedup == "minhash":
        step = signature_step(str(source.parent / "unused"))
        bands = [tuple(map(tuple, step.get_signature(step.get_shingles(d.text)))) for d in kept]
        edges = [(i, j) for i in range(len(kept)) for j in range(i) if any(a == b for a, b in zip(bands[i], bands[j]))]
        label = near_duplicates(np.array(edges, dtype=np.int64).reshape(-1, 2), len(kept))
        removed["near"] = [d.name for d, lab, i in zip(kept, label, range(len(kept))) if lab != i]
        kept = [d for d, lab, i in zip(kept, label, range(len(kept))) if lab == i]
    c = tok.contract
    out = {"train": [], "val": []}
    for d in kept:
        ids = tok.hf.encode(d.text, add_special_tokens=False).ids
        out[split_of(d.key, val_fraction)].append(np.array([*c.document_start, *ids, c.eos_id]))
    return out, removed


def check_shards(folder: Path, tok, want: dict) -> None:
    for split in ("train", "val"):
        got = read_split(folder, split, tok.contract.dtype)
        assert len(got) == len(want[split]) > 0
        assert all(np.array_equal(a, b) for a, b in zip(got, want[split]))


@pytest.mark.slow
def test_filters_remove_what_datatrove_rejects_the_same_at_any_number_of_tasks(tiny_tokenizer, corpus, tmp_path):
    path, texts, _ = corpus
    quality = Quality(("gopher_repetition", "fineweb_quality"))
    want, removed = reference(path, tiny_tokenizer, 0.2, quality)
    assert all(len(r) >= 1 for r in removed["filtered"])  # each filter removes something here
    metas, digests = {}, {}
    for n in (1, 2, 3):  # 1: one process, no executor
        metas[n] = prepare(str(path), tiny_tokenizer, tmp_path / f"n{n}", val_fraction=0.2, progress=False,
                           workers=n, quality=quality)
        digests[n] = folder_digest(tmp_path / f"n{n}")
    assert digests[2] == digests[1] and digests[3] == digests[1]
    check_shards(tmp_path / "n3", tiny_tokenizer, want)
    report = metas[3]["report"]
    assert [f["name"] for f in report["filters"]] == list(quality.filters)
    for f, docs in zip(report["filters"], removed["filtered"]):
        assert f["documents"] == len(docs) and f["bytes"] == sum(len(d.text.encode()) for d in docs)
        assert f["examples"] == [d.name for d in docs[:3]]
    assert metas[3]["skipped_filtered"] == {f: len(r) for f, r in zip(quality.filters, removed["filtered"])}
    assert metas[3]["skipped_duplicates"] == removed["exact"] == 2  # base[5] and base[59]: the junk copy is filtered
    assert {f"{path.name}:70", f"{path.name}:73"} <= {d.name for r in removed["filtered"] for d in r}  # the junk
    assert "near_duplicates_removed" not in report


@pytest.mark.slow
def test_minhash_removes_near_duplicates_keeping_the_first_in_the_stream(tiny_tokenizer, corpus, tmp_path):
    path, texts, near = corpus
    quality = Quality((), "minhash")
    want, removed = reference(path, tiny_tokenizer, 0.2, quality)
    assert sorted(removed["near"]) == sorted(f"{path.name}:{i + 1}" for i in near)  # the copies, not the originals
    metas, digests = {}, {}
    for n in (1, 2, 3):  # 1: one task on the executor (MinHash's stages)
        metas[n] = prepare(str(path), tiny_tokenizer, tmp_path / f"n{n}", val_fraction=0.2, progress=False,
                           workers=n, quality=quality)
        digests[n] = folder_digest(tmp_path / f"n{n}")
        assert not (tmp_path / f"n{n}{TASKS_SUFFIX}").exists()
    assert digests[2] == digests[1] and digests[3] == digests[1]
    check_shards(tmp_path / "n2", tiny_tokenizer, want)
    meta = metas[2]
    got = meta["report"]["near_duplicates_removed"]
    assert got["documents"] == meta["skipped_near_duplicates"] == len(near)
    assert got["bytes"] == sum(len(texts[i].encode()) for i in near)
    assert got["examples"][0] == [f"{path.name}:4", f"{path.name}:61"]  # (kept, removed): line 61 edits line 4
    assert meta["skipped_duplicates"] == 3  # exact copies stay exact duplicates (base[5], the junk, base[59])


def test_filters_and_minhash_together_and_a_mixture_passes_them(tiny_tokenizer, corpus, tmp_path):
    """Both at once on 2 tasks: the filtered documents are not near-duplicates' keepers; a mixture's
    source prepared with them holds the same documents and no tasks' files."""
    path, _, near = corpus
    quality = Quality(("fineweb_quality",), "minhash")
    want, removed = reference(path, tiny_tokenizer, 0.2, quality)
    meta = prepare(str(path), tiny_tokenizer, tmp_path / "both", val_fraction=0.2, progress=False, workers=2,
                   quality=quality)
    check_shards(tmp_path / "both", tiny_tokenizer, want)
    assert meta["skipped_near_duplicates"] == len(removed["near"]) == len(near)
    assert meta["skipped_filtered"] == {"fineweb_quality": len(removed["filtered"][0])}
    assert len(removed["filtered"][0]) >= 1
    from lmforge.data.mixture import mixture_sources, prepare_mixture

    metas = prepare_mixture(mixture_sources([{"source": str(path), "name": "web"}]), tiny_tokenizer, tmp_path / "mix",
                            val_fraction=0.2, progress=False, workers=2, quality=quality)
    assert metas["web"]["skipped_near_duplicates"] == len(near) and metas["web"]["input"]["dedup"] == "minhash"
    check_shards(tmp_path / "mix" / "web", tiny_tokenizer, want)
    left = [p.name for p in (tmp_path / "mix").rglob("*") if "tasks" in p.name]
    assert not left, left  # the tasks' files are gone once the folder is written


def test_each_filter_judges_the_text_as_written():
    """datatrove's C4 filter rewrites the text it judges (it drops lines); the filters after it
    still judge the document lmforge writes, so the order of data.filters does not change a verdict
    on a kept document."""
    lines = ["The river ran past the old mill, and the children watched it all day long."] * 6
    junk = [f"Home about contact menu item {i}" for i in range(60)]
    text = "\n".join(lines + junk)
    alone = DocFilters(("fineweb_quality",)).verdict(text)
    assert alone == 1  # the menu lines fail FineWeb's rules
    assert DocFilters(("c4_quality", "fineweb_quality")).verdict(text) == 2


def test_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match=r"data\.filters = \['gopher'\].*'gopher_quality'"):
        from_dict({"data": {"filters": ["gopher"]}}).validate()
    with pytest.raises(ConfigError, match=r"data\.filters.*distinct"):
        from_dict({"data": {"filters": ["c4_quality", "c4_quality"]}}).validate()
    with pytest.raises(ConfigError, match=r"data\.dedup"):
        from_dict({"data": {"dedup": "fuzzy"}}).validate()
    cfg = from_dict({"data": {"filters": ["gopher_quality", "c4_quality"], "dedup": "minhash"}}).validate()
    assert cfg.data.filters == ["gopher_quality", "c4_quality"] and cfg.data.dedup == "minhash"


def test_without_spacy_the_filters_are_a_config_error_and_nothing_is_written(tiny_tokenizer, corpus, tmp_path,
                                                                             monkeypatch):
    path, _, _ = corpus
    monkeypatch.setitem(sys.modules, "spacy", None)  # import spacy raises ImportError
    for quality in (Quality(("gopher_quality",)), Quality((), "minhash")):
        with pytest.raises(ConfigError, match=r'spacy is not installed.*lmforge\[filters\]'):
            prepare(str(path), tiny_tokenizer, tmp_path / "data", val_fraction=0.2, progress=False, workers=2,
                    quality=quality)
        assert not (tmp_path / "data").exists() and not (tmp_path / f"data{TASKS_SUFFIX}").exists()
