"""The tiktoken data-path encoder gives HF tokenizers' ids exactly (lmforge.data.fast_encode)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lmforge.data import fast_encode
from lmforge.data.fast_encode import FastEncodeUnsupported, FastEncoder, batch_encoder, tiktoken_encoding
from lmforge.data.sources import iter_documents
from lmforge.tokenizer import SPLIT_PATTERN, train_tokenizer

tiktoken = pytest.importorskip("tiktoken")

#: Strings where regex engines or BPE implementations could part ways.
TRICKY = [
    "<|eos|> <|im_start|>user\n<|pad|><|im_end|>",  # special spellings are plain text
    "x = 1\r\n\r\n\ty\t\t  \n   \n", "\r\n\r\n  \n\t\n", "  \r\n", "a\r\rb\n\r", "trailing   ",
    "数字١٢٣ ½ Ⅻ 𝟘𝟙 ٣٤", "naïve café Ωmega ΣΑΣ ǅ ﬁ", "DON'T it'S we'LL I'M 'Ve 'd's",
    "emoji 👩‍💻🏳️‍🌈 a\u0301 combining", "\u00a0nbsp\u2003emsp\u3000ideographic\u202fnarrow",
    "\x00\x01\x7f control", " " * 300 + "x", "=" * 200, "a" * 500, "\u2028ls\u2029ps \x0b\x0c \x85 NEL",
    "\x1c\x1d\x1e\x1f us", "\u180e mvs \u200b zwsp \ufeff bom", "\ue000\U0010ffff private",
    "\U0001e030\U00010d40\u0cf3\U0001e4d0 recent letters", "", " ", "\n",
]


def code_point_sweep(step: int) -> list[str]:
    """Text over the code points (every `step`-th), each next to letters, digits and spaces."""
    out = []
    for start in range(0, 0x110000, 0x1000):
        cs = [chr(c) for c in range(start, start + 0x1000, step) if not 0xD800 <= c < 0xE000]
        out.append("".join(f"a{c}b 1{c}2 {c}{c} '{c}s\n{c}\t" for c in cs))
    return out


def code_point_runs() -> list[str]:
    """Every code point once, in runs of 2048 (surrogates left out)."""
    cps = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    return [" x" + "".join(map(chr, cps[i:i + 2048])) + " 1" for i in range(0, len(cps), 2048)]


def stdlib_texts(max_bytes: int | None = None, skip_bytes: int = 0) -> list[str]:
    """Standard-library documents in corpus order, after `skip_bytes`, up to `max_bytes`."""
    texts, seen, used = [], 0, 0
    for doc in iter_documents("stdlib"):
        n = len(doc.text.encode("utf-8"))
        seen += n
        if seen <= skip_bytes:
            continue
        texts.append(doc.text)
        used += n
        if max_bytes and used >= max_bytes:
            break
    return texts


def assert_same_ids(tok, texts: list[str]) -> None:
    fast = batch_encoder(tok)
    assert isinstance(fast, FastEncoder)
    ours, theirs = fast(texts), tok.encode_batch(texts)
    assert len(ours) == len(theirs) == len(texts)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
            pytest.fail(f"text {i}: ids differ at token {j}: tiktoken {a[j:j + 5]} "
                        f"{tok.decode(a[j:j + 5])!r} vs HF {b[j:j + 5]} {tok.decode(b[j:j + 5])!r}")


@pytest.fixture(scope="module")
def small_tok(tmp_path_factory):
    """A 600-token BPE trained on ~150 KB of the standard library."""
    return train_tokenizer(stdlib_texts(150_000), 600, tmp_path_factory.mktemp("fe") / "tok", show_progress=False)


def test_ids_equal_hf_on_stdlib_sample_and_tricky_text(small_tok):
    texts = stdlib_texts(300_000, skip_bytes=2_000_000) + TRICKY + code_point_sweep(61)
    assert sum(len(t) for t in texts) > 300_000
    assert_same_ids(small_tok, texts)


def test_special_spellings_stay_plain_text(small_tok):
    ids = batch_encoder(small_tok)(["<|eos|>hi<|im_end|>"])[0]
    specials = set(small_tok.contract.special_tokens.values())
    assert not specials & set(ids)
    assert small_tok.decode(ids) == "<|eos|>hi<|im_end|>"


def test_threads_do_not_change_ids(small_tok):
    texts = stdlib_texts(60_000)
    enc = tiktoken_encoding(small_tok.folder)
    one, four = FastEncoder(enc, threads=1)(texts), FastEncoder(enc, threads=4)(texts)
    assert one == four == small_tok.encode_batch(texts)


def test_byte_decoder_inverts_hf_byte_level_alphabet():
    from tokenizers import pre_tokenizers

    table = fast_encode.byte_decoder()
    assert sorted(table.values()) == list(range(256))
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())
    # HF maps byte b to the char that the table maps back to b
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for b in range(128):
        (piece, _), = pre.pre_tokenize_str(chr(b))
        assert table[piece] == b


def test_ranks_follow_merge_order(small_tok):
    spec = json.loads(small_tok.hf.to_str())
    ranks = fast_encode.mergeable_ranks(spec)
    assert len(ranks) == small_tok.vocab_size - len(small_tok.contract.special_tokens)
    assert set(ranks.values()).isdisjoint(small_tok.contract.special_tokens.values())
    assert ranks[b" "] == spec["model"]["vocab"]["Ġ"]


@pytest.mark.parametrize("change, field", [
    (lambda s: s.__setitem__("normalizer", {"type": "NFC"}), "normalizer"),
    (lambda s: s["pre_tokenizer"]["pretokenizers"][0]["pattern"].__setitem__("Regex", r"\s+|\S+"), "Split pattern"),
    (lambda s: s["pre_tokenizer"]["pretokenizers"][1].__setitem__("add_prefix_space", True), "ByteLevel"),
    (lambda s: s["model"].__setitem__("ignore_merges", True), "model.ignore_merges"),
    (lambda s: s["model"].__setitem__("dropout", 0.1), "model.dropout"),
    (lambda s: s["added_tokens"][0].__setitem__("special", False), "added token"),
    (lambda s: s["model"]["merges"].reverse(), "merge order"),
    (lambda s: s["model"]["vocab"].__setitem__("ĠzzzzQQ", 10_000), "come from no merge"),
])
def test_unsupported_tokenizers_are_refused(small_tok, change, field):
    spec = json.loads(small_tok.hf.to_str())
    change(spec)
    with pytest.raises(FastEncodeUnsupported) as err:
        tiktoken_encoding(spec)
    msg = str(err.value)
    if field == "merge order":
        assert "merge order" in msg and "tiktoken needs ids in merge order" in msg
    else:
        assert field in msg
    assert "tokenizer.json" in msg


def test_split_pattern_in_tokenizer_is_the_one_checked(small_tok):
    spec = json.loads(small_tok.hf.to_str())
    assert spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == SPLIT_PATTERN


def test_falls_back_to_hf_without_tiktoken(small_tok, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken -> ImportError
    with pytest.raises(FastEncodeUnsupported, match="tiktoken is not installed"):
        tiktoken_encoding(small_tok.folder)
    enc = batch_encoder(small_tok)
    assert enc == small_tok.encode_batch
    assert enc(["def f(x): return x"]) == small_tok.encode_batch(["def f(x): return x"])


def test_lone_surrogate_fails_as_hf_does(small_tok):
    bad = "ok \ud800 no"
    with pytest.raises(Exception) as hf_err:
        small_tok.encode_batch([bad])
    with pytest.raises(Exception) as ours:
        batch_encoder(small_tok)([bad])
    assert type(ours.value) is type(hf_err.value)


def test_prepare_writes_identical_shards_with_either_encoder(tiny_corpus, tiny_tokenizer, tmp_path, monkeypatch):
    from lmforge.data import prepare as preparing

    fast = preparing.prepare(str(tiny_corpus), tiny_tokenizer, tmp_path / "fast", val_fraction=0.2, progress=False)
    monkeypatch.setattr(preparing, "batch_encoder", lambda tok: tok.encode_batch)
    slow = preparing.prepare(str(tiny_corpus), tiny_tokenizer, tmp_path / "hf", val_fraction=0.2, progress=False)
    assert fast["splits"] == slow["splits"]
    for split in ("train", "val"):
        a = np.fromfile(tmp_path / "fast" / f"{split}.bin", dtype=np.uint8)
        b = np.fromfile(tmp_path / "hf" / f"{split}.bin", dtype=np.uint8)
        assert a.size > 0 and np.array_equal(a, b)


@pytest.mark.slow
def test_ids_equal_hf_on_whole_stdlib(tmp_path):
    """The whole standard-library corpus (what `make speedrun` prepares) and every code point,
    with a 4096-token BPE trained on a 1.5 MB subset."""
    tok = train_tokenizer(stdlib_texts(1_500_000), 4096, tmp_path / "tok", show_progress=False)
    texts = stdlib_texts()
    assert sum(len(t.encode("utf-8")) for t in texts) > 5_000_000
    assert_same_ids(tok, texts + TRICKY + code_point_runs() + code_point_sweep(13))
