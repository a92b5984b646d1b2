"""Issue 54: one chat format for a model whichever door it comes in by.

A transformers folder without a chat template, of a family whose record (`export/families/`)
has a template, is imported by `lmforge import-hf` with that template, as `lmforge import-gguf`
imports the same model's template-less GGUF: the same contract chat template and special ids, no
token added (the embedding keeps its rows), the one log line saying so, and a chat rendered by
lmforge equal, id for id, to `transformers`' apply_chat_template with the family's template. A
family whose record has no template falls back to lmforge's ChatML, said in one line, as before.
The folders are saved by `transformers` itself (tests/hf_families.py), with no chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_families import build_folder  # noqa: E402

from lmforge.contract import Contract, padded_vocab_size  # noqa: E402
from lmforge.export import import_hf  # noqa: E402
from lmforge.export.families import FAMILIES, chat_template_of  # noqa: E402
from lmforge.model import load_model  # noqa: E402
from lmforge.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, Tokenizer, import_tokenizer  # noqa: E402

CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say 12345"},
     {"role": "assistant", "content": "12345"}, {"role": "user", "content": "def add(a, b):"}],
    [{"role": "user", "content": "The quick brown fox?"}, {"role": "assistant", "content": "jumps over the lazy dog."}],
]
TEXTS = ["def add(a, b):\n    return a + b", " leading space", "café <end_of_turn> <|im_start|> 12345", ""]


def record_of(folder: Path):
    """The family record of a saved folder, by its config.json (as import-hf finds it)."""
    return FAMILIES[json.loads((folder / "config.json").read_text())["model_type"]]


def template_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("chat template:")]


def bare_folder(family: str, folder: Path, **overrides):
    """`family`'s tiny model and tokenizer as transformers saves them, with no chat template."""
    model, fast = build_folder(family, folder, template=None, **overrides)
    assert not (folder / "chat_template.jinja").exists()
    assert json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template") is None
    return model, fast


#: families whose record has a chat template, and families whose record has none (lmforge's ChatML)
WITH_TEMPLATE = ("gemma3", "gemma2", "phi3")
WITHOUT_TEMPLATE = ("olmo2", "qwen3", "mistral")


def test_the_records_say_which_have_a_template(tmp_path):
    """The split of the tests below is the records' own (not a guess at family names)."""
    for family in (*WITH_TEMPLATE, *WITHOUT_TEMPLATE):
        build_folder(family, tmp_path / family, template=None)
        record = record_of(tmp_path / family)
        assert (record.chat_template is not None) == (family in WITH_TEMPLATE), family
        chosen = chat_template_of(record)
        assert chosen.template == record.chat_template and chosen.end_of_turn == record.end_of_turn
    assert chat_template_of(None) is None


@pytest.mark.parametrize("family", WITH_TEMPLATE)
def test_template_less_folder_takes_its_familys_template(family, tmp_path):
    hf, fast = bare_folder(family, tmp_path / "hf")
    record = record_of(tmp_path / "hf")
    lines: list[str] = []
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ckpt", log=lines.append)
    c = Contract.load(ckpt)
    assert c.chat_template == record.chat_template
    # no token added for chat: the tokenizer's vocabulary and the embedding's rows are the model's own
    # (Phi-3's pad_token is its EOS: a pad of lmforge's own is added, said in its "pad:" line)
    pad_added = int(any(line.startswith("pad:") and "one added token" in line for line in lines))
    assert c.vocab_size == len(fast) + pad_added
    tok = Tokenizer.load(ckpt)
    vocab = tok.hf.get_vocab(with_added_tokens=True)
    assert SPECIAL_TOKENS["im_start"] not in vocab and SPECIAL_TOKENS["im_end"] not in vocab
    assert c.im_end_id == fast.convert_tokens_to_ids(record.end_of_turn) and c.im_start_id is None
    ours = load_model(ckpt)[0]
    rows = ours.tok_embeddings.weight
    assert rows.shape[0] == padded_vocab_size(len(fast) + pad_added)
    torch.testing.assert_close(rows[: len(fast)], hf.model.embed_tokens.weight[: len(fast)], atol=0, rtol=0)
    # said in one line, naming the family; no ChatML token added
    said = template_lines(lines)
    assert len(said) == 1 and record.architecture in said[0] and "ChatML" not in said[0], lines
    assert not [line for line in lines if "adding it" in line], lines
    # lmforge's rendering = transformers' apply_chat_template with the family's template
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert auto.chat_template is None
    for chat in CHATS:
        for gen in (False, True):
            if gen and chat[-1]["role"] == "assistant":
                continue
            want = list(auto.apply_chat_template(chat, chat_template=record.chat_template, tokenize=True,
                                                 add_generation_prompt=gen, return_dict=False))
            assert tok.render_chat(chat, add_generation_prompt=gen).ids == want, (chat, gen)


@pytest.mark.parametrize("family", WITHOUT_TEMPLATE)
def test_template_less_folder_of_a_family_without_one_gets_chatml(family, tmp_path):
    _, fast = bare_folder(family, tmp_path / "hf")
    record = record_of(tmp_path / "hf")
    lines: list[str] = []
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ckpt", log=lines.append)
    c = Contract.load(ckpt)
    assert c.chat_template == CHAT_TEMPLATE
    vocab = fast.get_vocab()
    missing = [t for t in (SPECIAL_TOKENS["im_start"], SPECIAL_TOKENS["im_end"]) if t not in vocab]
    tok = Tokenizer.load(ckpt)
    assert c.im_start_id == tok.hf.token_to_id(SPECIAL_TOKENS["im_start"])
    assert c.im_end_id == tok.hf.token_to_id(SPECIAL_TOKENS["im_end"])
    said = template_lines(lines)
    assert len(said) == 1 and "ChatML" in said[0] and record.architecture in said[0], lines
    assert len([line for line in lines if "adding it" in line]) == len(missing), lines


def test_a_tokenizer_of_no_family_gets_chatml(tmp_path):
    """import-tokenizer knows no model: lmforge's ChatML, said in one line."""
    bare_folder("gemma3", tmp_path / "hf")
    lines: list[str] = []
    tok = import_tokenizer(tmp_path / "hf", tmp_path / "tok", log=lines.append)
    assert tok.contract.chat_template == CHAT_TEMPLATE
    said = template_lines(lines)
    assert len(said) == 1 and "ChatML" in said[0], lines


#: what llama.cpp can run of hf_families' Gemma models: query_pre_attn_scalar = head_dim
GGUF_OVERRIDES = {"gemma3": {"query_pre_attn_scalar": 48}, "gemma2": {"query_pre_attn_scalar": 48}}


@pytest.mark.parametrize("family", WITH_TEMPLATE)
def test_hf_and_gguf_doors_give_the_same_chat_format(family, tmp_path, monkeypatch):
    """import-hf of the template-less folder = import-gguf of the same model's template-less GGUF:
    chat template, special ids, vocabulary size, BOS rule, token ids and chat renderings."""
    pytest.importorskip("gguf")
    import gguf

    import lmforge.export.gguf as gguf_out
    from lmforge.export import export_gguf, import_gguf

    # the same model with its template, through import-hf, written as a GGUF without tokenizer.chat_template
    build_folder(family, tmp_path / "own", **GGUF_OVERRIDES.get(family, {}))
    import_hf(tmp_path / "own", tmp_path / "own-ckpt")
    keys = gguf_out.tokenizer_keys
    monkeypatch.setattr(gguf_out, "tokenizer_keys",
                        lambda c, v: {k: x for k, x in keys(c, v).items() if k != "chat_template"})
    path = export_gguf(tmp_path / "own-ckpt", tmp_path / "bare.gguf")
    assert "tokenizer.chat_template" not in gguf.GGUFReader(str(path)).fields
    gguf_lines: list[str] = []
    by_gguf = import_gguf(path, tmp_path / "by-gguf", log=gguf_lines.append)

    _, fast = bare_folder(family, tmp_path / "hf", **GGUF_OVERRIDES.get(family, {}))
    hf_lines: list[str] = []
    by_hf = import_hf(tmp_path / "hf", tmp_path / "by-hf", log=hf_lines.append)

    record = record_of(tmp_path / "hf")
    g, h = Contract.load(by_gguf), Contract.load(by_hf)
    assert h.chat_template == g.chat_template == record.chat_template
    for key in ("special_tokens", "vocab_size", "add_bos"):
        assert getattr(h, key) == getattr(g, key), key
    assert h.vocab_size == len(fast) + any(x.startswith("pad:") and "one added token" in x for x in hf_lines)
    tg, th = Tokenizer.load(by_gguf), Tokenizer.load(by_hf)
    assert [th.encode(t) for t in TEXTS] == [tg.encode(t) for t in TEXTS]
    for chat in CHATS:
        assert th.render_chat(chat).ids == tg.render_chat(chat).ids
    # each door says it in one line, naming what it was given (the file, not a temporary folder)
    for lines, given in ((gguf_lines, path), (hf_lines, tmp_path / "hf")):
        said = template_lines(lines)
        assert len(said) == 1 and str(given) in said[0] and record.architecture in said[0], lines
    assert "lmforge-gguf-" not in " ".join(gguf_lines)
