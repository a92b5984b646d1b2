"""The embedded default preference pairs (lmforge.data.stdlib_pairs): each mutation kind does
what it says and parses; lengths stay within the bound; every direction is as frequent as
its reverse; the split is SFT's; the set is deterministic."""

from __future__ import annotations

import ast
from collections import Counter

import pytest

from lmforge.data.preferences import pair_from_record
from lmforge.data.sources import Document
from lmforge.data.stdlib_functions import function_examples, place_body, stdlib_examples
from lmforge.data.stdlib_pairs import (KINDS, MAX_LENGTH_CHANGE, PairStats, apply_edit, body_edits, reverse,
                                       stdlib_preference_pairs)

SOURCE = '''
def compare(a, b):
    """Compare."""
    if a == b and a < 3:
        return True
    if not b:
        return None
    while a:
        a = a // 2
    return pow(a, b) + 1


def nothing_to_mutate(x):
    """Only a name."""
    return x
'''


def example(name):
    return next(e for e in function_examples(SOURCE, "m") if e.qualname == name)


def test_each_kind_makes_its_one_change_and_parses():
    ex = example("compare")
    made = {}
    for edit in body_edits(ex):
        body = apply_edit(ex, edit)
        assert body is not None and body != ex.body
        ast.parse(place_body(ex.signature, body))
        assert abs(len(body) - len(ex.body)) <= MAX_LENGTH_CHANGE
        made.setdefault(edit[0], []).append((edit[1], body))
    bodies = {k: [b for _, b in v] for k, v in made.items()}
    assert "    if a != b and a < 3:" in bodies["compare_eq"][0]
    assert any("a <= 3" in b for b in bodies["compare_lt"])
    assert any("a == b or a < 3" in b for b in bodies["bool_op"])
    assert any("return False" in b for b in bodies["bool_const"])
    assert any("pow(a, b) - 1" in b for b in bodies["plus_minus_1"])
    assert any("pow(b, a) + 1" in b for b in bodies["swap_args"])
    assert any("    if b:" in b for b in bodies["not"])  # dropped
    assert any("    while not a:" in b for b in bodies["not"])  # added
    assert set(made) == set(KINDS)  # every kind has a site here
    assert body_edits(example("nothing_to_mutate")) == []


def test_a_function_without_a_site_is_skipped_and_counted():
    stats = PairStats()
    docs = [Document("m", SOURCE, "m")]
    pairs = stdlib_preference_pairs(0.0, stats=stats, documents=docs)
    assert [r["name"] for r in pairs["train"]] == ["m:compare"] and stats.no_site == 1
    rec = pairs["train"][0]
    pair = pair_from_record(rec, rec["name"])  # the DPO reader takes the records as they are
    assert pair.mutation == rec["mutation"] and pair.chosen == example("compare").body


@pytest.fixture(scope="module")
def real():
    stats = PairStats()
    pairs = stdlib_preference_pairs(0.02, seed=0, max_train=600, max_chars=900, stats=stats)
    return pairs, stats


def test_on_the_real_library_every_direction_is_as_frequent_as_its_reverse(real):
    pairs, stats = real
    for split in ("train", "val"):
        dirs = stats.directions[split]
        for (kind, direction), n in dirs.items():
            assert abs(n - dirs[(kind, reverse(direction))]) <= 1, (split, kind, direction, dict(dirs))
        assert sum(dirs.values()) == len(pairs[split])
    kinds = Counter(r["mutation"] for r in pairs["train"])
    assert set(kinds) == set(KINDS) and len(pairs["train"]) > 200
    for r in pairs["train"] + pairs["val"]:
        chosen, rejected = r["chosen"][0]["content"], r["rejected"][0]["content"]
        assert chosen != rejected and abs(len(chosen) - len(rejected)) <= MAX_LENGTH_CHANGE


def test_the_split_is_sfts_and_the_set_is_deterministic(real):
    pairs, _ = real
    sft = stdlib_examples(0.02, 900, 600)
    sft_names = {split: {f"{e.module}:{e.qualname}" for e in exs} for split, exs in sft.items()}
    for split in ("train", "val"):
        assert {r["name"] for r in pairs[split]} <= sft_names[split]
        turns = {(c.messages[0]["content"], c.messages[1]["content"]) for c in (e.conversation() for e in sft[split])}
        for r in pairs[split]:  # the prompt is an SFT user turn, the chosen reply its real body
            assert (r["prompt"][0]["content"], r["chosen"][0]["content"]) in turns
    assert stdlib_preference_pairs(0.02, seed=0, max_train=600, max_chars=900) == pairs
    assert stdlib_preference_pairs(0.02, seed=1, max_train=600, max_chars=900) != pairs
