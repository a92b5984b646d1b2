"""Supervised fine-tuning: data shapes and bad input, the chat template against transformers,
the assistant-only mask with its end-of-turn target, the length policy, right-padded and
packed rows, the standard-library set and its split, the stage, and `lmforge chat`."""

from __future__ import annotations

import inspect
import io
import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge import cli
from lmforge.data.conversations import (
    cap_examples,
    read_conversations,
    render_samples,
    sft_batches,
    sft_stream,
    split_conversations,
)
from lmforge.data.stdlib_functions import STDLIB_PROMPT, function_examples, place_body, stdlib_examples
from lmforge.data.sources import Document, iter_documents, split_of
from lmforge.errors import ConfigError, ContractError, DataError
from lmforge.model import Transformer, resolve_model_config
from lmforge.stages.generate import chat_loop, chat_prompt
from lmforge.stages.sft import SFT_DATA_FILE, SFT_VAL_FILE, sft_stage
from lmforge.scorers import body_parse_rate
from lmforge.tokenizer import train_tokenizer
from lmforge.model import load_model
from lmforge.train.checkpoint import save_checkpoint

ROOT = Path(__file__).resolve().parents[1]

OPENAI = [
    {"messages": [{"role": "system", "content": "You write Python."},
                  {"role": "user", "content": "def value(self):"},
                  {"role": "assistant", "content": "    return self.value"},
                  {"role": "user", "content": "and key?"},
                  {"role": "assistant", "content": "    return self.key"}]},
    {"messages": [{"role": "user", "content": "print x"}, {"role": "assistant", "content": "print(x)"}]},
]
SHAREGPT = [
    {"conversations": [{"from": "system", "value": "You write Python."},
                       {"from": "human", "value": "def value(self):"},
                       {"from": "gpt", "value": "    return self.value"},
                       {"from": "human", "value": "and key?"},
                       {"from": "gpt", "value": "    return self.key"}]},
    {"conversations": [{"from": "human", "value": "print x"}, {"from": "gpt", "value": "print(x)"}]},
]
ALPACA = [
    {"instruction": "Return the name.", "input": "def name(self):", "output": "    return self.name"},
    {"instruction": "print x", "input": "", "output": "print(x)"},
    {"instruction": "print y", "output": "print(y)"},
]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def write_parquet(path: Path, records) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def many_conversations(n: int = 40) -> list[dict]:
    words = ["value", "return", "self", "data", "items", "key", "name", "result", "tokens", "print"]
    out = []
    for i in range(n):
        user = " ".join(words[(i + j) % 10] for j in range(3 + i % 5))
        reply = " ".join(words[(3 * i + j) % 10] for j in range(2 + i % 7))
        out.append({"messages": [{"role": "user", "content": f"{i}: {user}"},
                                 {"role": "assistant", "content": reply}]})
    return out


# -- data shapes ---------------------------------------------------------------------------------
def _messages(convs):
    return [list(c.messages) for c in convs]


def test_openai_and_sharegpt_shapes_read_the_same(tmp_path):
    a = read_conversations(write_jsonl(tmp_path / "a.jsonl", OPENAI))
    b = read_conversations(write_jsonl(tmp_path / "b.jsonl", SHAREGPT))
    assert _messages(a) == [r["messages"] for r in OPENAI]
    assert _messages(b) == _messages(a)
    assert [c.key for c in a] == [c.key for c in b]  # the split follows the content, not the shape
    assert a[0].name == f"{tmp_path / 'a.jsonl'}:1"


def test_alpaca_shape(tmp_path):
    convs = read_conversations(write_jsonl(tmp_path / "c.jsonl", ALPACA + [dict(ALPACA[1], input=None)]))
    assert _messages(convs) == [
        [{"role": "user", "content": "Return the name.\n\ndef name(self):"},
         {"role": "assistant", "content": "    return self.name"}],
        [{"role": "user", "content": "print x"}, {"role": "assistant", "content": "print(x)"}],
        [{"role": "user", "content": "print y"}, {"role": "assistant", "content": "print(y)"}],
        [{"role": "user", "content": "print x"}, {"role": "assistant", "content": "print(x)"}],
    ]


@pytest.mark.parametrize("records", [OPENAI, SHAREGPT, ALPACA], ids=["openai", "sharegpt", "alpaca"])
def test_parquet_reads_like_jsonl(tmp_path, records):
    j = read_conversations(write_jsonl(tmp_path / "d.jsonl", records))
    p = read_conversations(write_parquet(tmp_path / "d.parquet", records))
    assert _messages(p) == _messages(j)
    assert p[1].name == f"{tmp_path / 'd.parquet'} row 2"


def test_shapes_may_mix_in_one_file(tmp_path):
    convs = read_conversations(write_jsonl(tmp_path / "m.jsonl", [OPENAI[1], SHAREGPT[1], ALPACA[1]]))
    assert _messages(convs) == [_messages(convs)[0]] * 3


BAD = [
    ("no_role", [OPENAI[1], {"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}], 2,
     'message 0 has no "role"'),
    ("unknown_role", [{"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "x"}]}], 1,
     "role 'bot'"),
    ("ends_on_user", [OPENAI[0], {"messages": [{"role": "user", "content": "hi"}]}], 2,
     "ends on a 'user' turn"),
    ("ends_on_user_multi", [{"messages": OPENAI[0]["messages"] + [{"role": "user", "content": "more?"}]}], 1,
     "ends on a 'user' turn"),
    ("sharegpt_unknown_from", [{"conversations": [{"from": "bot", "value": "x"}]}], 1, "\"from\" = 'bot'"),
    ("sharegpt_no_from", [{"conversations": [{"value": "x"}]}], 1, 'turn 0 has no "from"'),
    ("content_not_str", [{"messages": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "x"}]}],
     1, "expected a string"),
    ("empty_messages", [{"messages": []}], 1, "non-empty list"),
    ("unknown_shape", [{"text": "hello"}], 1, "unknown record shape"),
    ("alpaca_no_output", [{"instruction": "x"}], 1, 'Alpaca field "output"'),
]


@pytest.mark.parametrize("name,records,line,phrase", BAD, ids=[b[0] for b in BAD])
def test_bad_records_name_file_and_line(tmp_path, name, records, line, phrase):
    path = write_jsonl(tmp_path / f"{name}.jsonl", records)
    with pytest.raises(DataError) as exc:
        read_conversations(path)
    assert f"{path}:{line}:" in str(exc.value)
    assert phrase in str(exc.value)


def test_bad_parquet_row_is_named(tmp_path):
    records = [OPENAI[1], {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x"}]}]
    path = write_parquet(tmp_path / "bad.parquet", records)
    with pytest.raises(DataError, match=r"bad\.parquet row 2: the conversation ends on a 'user' turn"):
        read_conversations(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"], ids=["zero_bytes", "blank_lines"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match="holds no conversations") as exc:
        read_conversations(path)
    assert str(path) in str(exc.value)


def test_invalid_json_and_missing_file(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(OPENAI[1]) + "\n{not json\n")
    with pytest.raises(DataError, match=r"x\.jsonl:2: not valid JSON"):
        read_conversations(path)
    with pytest.raises(DataError, match="does not exist"):
        read_conversations(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        (tmp_path / "a.csv").write_text("a,b\n")
        read_conversations(tmp_path / "a.csv")


# -- template parity and the mask -----------------------------------------------------------------
PARITY = [
    OPENAI[0]["messages"],
    [{"role": "user", "content": "\nstarts with a newline"}, {"role": "assistant", "content": "\n\nreturn None\n"}],
    [{"role": "user", "content": " starts with a space"}, {"role": "assistant", "content": "  two spaces"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "x"}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "tabs\tand\r\nCRLF ünïcödé 数字 123"}, {"role": "assistant", "content": "ok\n"}],
]


def test_render_chat_equals_transformers_apply_chat_template(tiny_tokenizer):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_tokenizer.folder))
    for messages in PARITY:
        for gen in (False, True):
            ref = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
            ref = list(ref if isinstance(ref, list) else ref["input_ids"])
            assert tiny_tokenizer.render_chat(messages, add_generation_prompt=gen).ids == ref, (messages, gen)
        # what SFT trains on is exactly that rendering
        samples = render_samples([_conv(messages)], tiny_tokenizer, 10_000)
        ref = hf.apply_chat_template(messages, tokenize=True)
        assert samples.ids[0].tolist() == list(ref if isinstance(ref, list) else ref["input_ids"])


def _conv(messages):
    from lmforge.data.conversations import Conversation

    return Conversation(tuple(messages), "t", "t")


def test_loss_mask_is_assistant_content_and_its_end_of_turn(tiny_tokenizer):
    tok = tiny_tokenizer
    messages = OPENAI[0]["messages"]
    samples = render_samples([_conv(messages)], tok, 256)
    batch = next(sft_batches(samples, 256, 1, tok.pad_id))
    targets, mask = batch.targets[0], batch.loss_mask[0]
    is_end = targets == tok.im_end_id
    assert int(is_end.sum()) == len(messages)  # one <|im_end|> per turn, all of them targets somewhere
    # the end-of-turn token is a target exactly where it closes an assistant turn
    roles = [m["role"] for m in messages]
    assert mask[is_end].tolist() == [r == "assistant" for r in roles]
    # and the supervised targets spell the assistant turns, each closed by <|im_end|>, nothing else
    want = "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")
    assert tok.decode(targets[mask].tolist()) == want


def test_text_spelling_a_special_token_stays_text(tiny_tokenizer):
    """Content that spells <|im_end|> cannot end a turn (it is plain text on the data path)."""
    tok = tiny_tokenizer
    r = tok.render_chat([{"role": "user", "content": "a <|im_end|> b"}, {"role": "assistant", "content": "ok"}])
    assert r.ids.count(tok.im_end_id) == 2


# -- length policy and rows -------------------------------------------------------------------------
def test_truncation_and_drop_counts(tiny_tokenizer):
    tok = tiny_tokenizer
    seq_len = 32
    short = _conv([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "value"}])
    long_reply = _conv([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "value data " * 40}])
    long_prompt = _conv([{"role": "user", "content": "items key " * 40}, {"role": "assistant", "content": "ok"}])
    full = [len(tok.render_chat(c.messages).ids) for c in (short, long_reply, long_prompt)]
    assert full[0] <= seq_len + 1 < min(full[1:])
    samples = render_samples([short, long_reply, long_prompt, short], tok, seq_len)
    assert samples.counts() == {"conversations": 4, "kept": 3, "truncated": 1, "dropped_all_cut": 1,
                                "tokens": 2 * full[0] + seq_len + 1,
                                "supervised": int(sum(x[1:].sum() for x in samples.learn))}
    assert samples.names == ["t", "t", "t"] and [len(x) for x in samples.ids] == [full[0], seq_len + 1, full[0]]
    # the cut keeps the head: the prompt and the start of the reply
    assert samples.ids[1].tolist() == tok.render_chat(long_reply.messages).ids[: seq_len + 1]
    for packing in (False, True):
        rows = sft_stream(samples, seq_len, 1, tok.pad_id, 0, packing=packing, shuffle=False).plan(0)
        assert sorted(n for r in rows for _, _, n in r) == sorted(len(x) - 1 for x in samples.ids)


def _samples(tok, n=6):
    from lmforge.data.conversations import Conversation

    convs = [Conversation(tuple(r["messages"]), str(i), str(i)) for i, r in enumerate(many_conversations(n))]
    return render_samples(convs, tok, 64)


def test_padded_rows_have_no_attention_mask_and_pads_cannot_leak(tiny_run):
    cfg, tok = tiny_run
    samples = _samples(tok)
    batch = sft_stream(samples, 64, 6, tok.pad_id, 0, packing=False, shuffle=False).next_batch()
    real = torch.zeros_like(batch.loss_mask)
    for i, x in enumerate(samples.ids):
        real[i, : len(x) - 1] = True
        assert batch.tokens[i, : len(x) - 1].tolist() == x[:-1].tolist()
    assert (~real).any(dim=1).all()  # every row is right-padded
    assert (batch.document_ids == 0).all()  # one segment: plain causal attention, no mask
    assert (batch.positions == torch.arange(64)).all()
    assert not batch.loss_mask[~real].any()
    model = Transformer(resolve_model_config(cfg.model, tok.contract)).eval()
    with torch.no_grad():
        a = model(batch.tokens, batch.positions, batch.document_ids)
        perturbed = torch.where(real, batch.tokens, torch.randint_like(batch.tokens, 0, tok.vocab_size))
        b = model(perturbed, batch.positions, batch.document_ids)
    assert torch.equal(a[real], b[real])


def test_packed_and_padded_rows_give_the_same_loss(tiny_run):
    """sft.packing (the default) is exact: the same conversations packed with document masking
    and per-conversation positions, or one per right-padded row, give the same summed loss over
    the same supervised targets (float tolerance: other sums in another order)."""
    cfg, tok = tiny_run
    samples = _samples(tok, 12)
    model = Transformer(resolve_model_config(cfg.model, tok.contract)).eval()

    def total(packing: bool) -> tuple[float, int, int]:
        nats, n, rows = 0.0, 0, 0
        for b in sft_batches(samples, 64, 4, tok.pad_id, packing=packing):
            with torch.no_grad():
                nats += float(model(b.tokens, b.positions, b.document_ids, targets=b.targets, loss_mask=b.loss_mask))
            n, rows = n + int(b.loss_mask.sum()), rows + b.tokens.shape[0]
        return nats, n, rows

    (padded, n_padded, rows_padded), (packed, n_packed, rows_packed) = total(False), total(True)
    assert n_packed == n_padded > 0 and rows_packed < rows_padded  # the same targets in fewer rows
    assert packed == pytest.approx(padded, rel=1e-5)


def test_packed_rows_mask_documents_and_keep_the_same_targets(tiny_tokenizer):
    tok = tiny_tokenizer
    samples = _samples(tok, 12)
    padded = next(sft_batches(samples, 64, 100, tok.pad_id, packing=False))
    packed = next(sft_batches(samples, 64, 100, tok.pad_id, packing=True))
    assert packed.tokens.shape[0] < padded.tokens.shape[0]  # several conversations per row
    for row in range(packed.tokens.shape[0]):
        docs = packed.document_ids[row]
        for d in docs.unique():
            where = (docs == d).nonzero().flatten()
            assert (packed.positions[row, where] == torch.arange(len(where))).all()
            starts = packed.tokens[row, where[0]]
            if packed.loss_mask[row, where].any():
                assert int(starts) == tok.im_start_id  # each document is one whole conversation
    key = lambda b: sorted(zip(b.tokens[b.loss_mask].tolist(), b.targets[b.loss_mask].tolist()))  # noqa: E731
    assert key(packed) == key(padded)


# -- the standard-library set -----------------------------------------------------------------------
MODULE = '''\
import os


@decorator
def area(width: float,
         height: float = 1.0) -> float:
    """Area of a rectangle.

    More words.
    """
    # a comment before the body
    return width * height


def no_doc(x):
    return x


def only_doc():
    """Nothing else."""


def one_line(): """doc"""; return 1


class Shape:
    """A shape."""

    def scale(self, k):
        """Scale by k."""
        def inner(v):
            """Inner helper."""
            return v * k
        self.size = inner(self.size)
        return self

if os.name:
    async def fetch(url):
        """Fetch url."""
        text = """
not indented"""
        await url.get()
'''


def test_function_examples_extracts_signature_docstring_and_body():
    found = {e.qualname: e for e in function_examples(MODULE, "geometry")}
    assert sorted(found) == ["Shape.scale", "Shape.scale.inner", "area"]  # fetch: a string at column 0
    a = found["area"]
    assert a.signature == "def area(width: float,\n         height: float = 1.0) -> float:"
    assert a.docstring == '    """Area of a rectangle.\n\n    More words.\n    """'
    assert a.body == "    # a comment before the body\n    return width * height"
    inner = found["Shape.scale.inner"]
    assert (inner.signature, inner.body) == ("def inner(v):", "    return v * k")
    assert found["Shape.scale"].body.startswith("    def inner(v):\n")
    for e in found.values():
        compile(place_body(e.signature, e.body), "<test>", "exec")
        conv = e.conversation()
        assert conv.messages[0]["content"] == STDLIB_PROMPT + e.signature + "\n" + e.docstring
        assert conv.messages[1] == {"role": "assistant", "content": e.body}
        assert conv.key == "geometry"
    # a form feed is no line break for ast (the standard library has some)
    ff = function_examples('x = 1\n\x0c\ndef f(a):\n    """Doc."""\n    return a\n', "m")
    assert [(e.signature, e.docstring, e.body) for e in ff] == [("def f(a):", '    """Doc."""', "    return a")]


def test_stdlib_split_follows_pretraining_and_nothing_leaks():
    vf = 0.3
    docs = list(islice(iter_documents("stdlib", None, vf), 40))
    pre_val = {d.key for d in iter_documents("stdlib", "val", vf) if d.key in {x.key for x in docs}}
    pre_train = {d.key for d in docs} - pre_val
    ex = stdlib_examples(vf, documents=docs)
    train_mods, val_mods = {e.module for e in ex["train"]}, {e.module for e in ex["val"]}
    assert train_mods and val_mods
    assert val_mods <= pre_val and train_mods <= pre_train and not train_mods & pre_val
    assert ex == stdlib_examples(vf, documents=docs)  # deterministic
    capped = stdlib_examples(vf, max_train=10, documents=docs)
    assert len(capped["train"]) == 10 and {e.module for e in capped["train"]} <= pre_train
    assert capped["val"] == ex["val"]  # the cap never moves validation
    one = stdlib_examples(vf, documents=docs, max_per_module=1)
    per_module = Counter(e.module for e in ex["train"] + ex["val"])
    assert max(per_module.values()) > 1 and max(Counter(e.module for e in one["train"]).values()) == 1
    assert {e.module for e in one["train"]} == train_mods and {e.module for e in one["val"]} == val_mods


def test_function_copied_into_a_validation_module_is_left_out_of_validation():
    keys = [f"mod{i}" for i in range(50)]
    val_key = next(k for k in keys if split_of(k, 0.5) == "val")
    train_key = next(k for k in keys if split_of(k, 0.5) == "train")
    docs = [Document(f"{k}.py", MODULE, k) for k in (train_key, val_key)]
    from lmforge.data.stdlib_functions import StdlibStats

    stats = StdlibStats()
    ex = stdlib_examples(0.5, documents=docs, stats=stats)
    assert len(ex["train"]) == 3 and ex["val"] == [] and stats.val_duplicates == 3


def test_cap_examples_is_stable_and_keeps_order():
    items = [f"x{i}" for i in range(100)]
    a = cap_examples(items, 10, str)
    assert a == cap_examples(list(reversed(items)), 10, str)[::-1] and len(a) == 10
    assert a == sorted(a, key=items.index)
    assert cap_examples(items, 0, str) == items


def test_split_conversations_by_content(tmp_path):
    convs = read_conversations(write_jsonl(tmp_path / "m.jsonl", many_conversations(200)))
    parts = split_conversations(convs, 0.2)
    assert 20 < len(parts["val"]) < 60 and len(parts["train"]) + len(parts["val"]) == 200
    assert all(split_of(c.key, 0.2) == "val" for c in parts["val"])


# -- the stage ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def init_ckpt(tiny_run, tmp_path_factory):
    """A tiny 'pretrained' checkpoint (random weights) written by save_checkpoint."""
    cfg, tok = tiny_run
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    model.reset_parameters(seed=0)
    return save_checkpoint(tmp_path_factory.mktemp("pre"), 3, model, cfg, tok.folder)


def sft_cfg(cfg, init, data, **sft):
    base = dict(init=str(init), data=str(data), steps=3, micro_batch_size=2, grad_accum_steps=2, lr=1e-2,
                warmup_steps=1, val_examples=0)
    base.update(sft)
    return replace(cfg, sft=replace(cfg.sft, **base), data=replace(cfg.data, val_fraction=0.25))


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_sft_stage_trains_from_init_with_the_same_loop(tiny_run, init_ckpt, tmp_path, packing):
    cfg, tok = tiny_run
    data = write_jsonl(tmp_path / "chat.jsonl", many_conversations(40))
    cfg = sft_cfg(cfg, init_ckpt, data, packing=packing)
    last = sft_stage(cfg, tmp_path / "sft", progress=False)
    run = tmp_path / "sft"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert np.isfinite(last["val_loss"]) and last["val_loss"] > 0
    info = json.loads((run / SFT_DATA_FILE).read_text())
    n_val = len([x for x in (run / SFT_VAL_FILE).read_text().splitlines() if x])
    assert info["splits"]["train"]["conversations"] + n_val == 40 and n_val > 0
    assert info["packing"] is packing
    model, saved, _, path = load_model(run)
    assert path.name == "step_000003"
    assert saved.train.steps == 3 and saved.train.micro_batch_size == 2 and saved.train.lr == 1e-2
    assert saved.model == load_model(init_ckpt)[1].model
    # the weights moved away from the initial checkpoint
    init_model = load_model(init_ckpt)[0]
    assert not torch.equal(model.output.weight, init_model.output.weight)


def test_pretrain_and_sft_use_the_same_loss_and_loop(tiny_run, init_ckpt, tmp_path, monkeypatch):
    from lmforge.stages import pretrain_stage
    from lmforge.model import transformer as loss_mod  # the loss op, as the model calls it
    from lmforge.train import trainer as trainer_mod

    calls = {"loss": 0, "steps": []}
    real_loss, real_step = loss_mod.linear_cross_entropy_sum, trainer_mod.Trainer.train_step

    def counting_loss(*a, **k):
        calls["loss"] += 1
        return real_loss(*a, **k)

    def counting_step(self):
        calls["steps"].append(type(self))
        return real_step(self)

    monkeypatch.setattr(loss_mod, "linear_cross_entropy_sum", counting_loss)
    monkeypatch.setattr(trainer_mod.Trainer, "train_step", counting_step)
    cfg, tok = tiny_run
    pretrain_stage(replace(cfg, train=replace(cfg.train, steps=1)), tmp_path / "pre", progress=False)
    after_pretrain = calls["loss"]
    data = write_jsonl(tmp_path / "chat.jsonl", many_conversations(20))
    sft_stage(sft_cfg(cfg, init_ckpt, data, steps=1, grad_accum_steps=1), tmp_path / "sft", progress=False)
    assert after_pretrain > 0 and calls["loss"] > after_pretrain
    assert calls["steps"] == [trainer_mod.Trainer, trainer_mod.Trainer]
    from lmforge.model import transformer as transformer_mod
    from lmforge.stages import pretrain as pretrain_mod, sft as sft_mod

    # the model's forward(targets=...) is the only caller, in both stages
    assert "linear_cross_entropy_sum(" in inspect.getsource(transformer_mod.Transformer.forward)
    assert sft_mod.run_training is pretrain_mod.run_training
    assert sft_mod.run_training.__module__ == "lmforge.stages.common"


def test_sft_stage_errors(tiny_run, init_ckpt, tmp_path, tiny_corpus):
    cfg, tok = tiny_run
    data = write_jsonl(tmp_path / "chat.jsonl", many_conversations(10))
    with pytest.raises(ConfigError, match="sft.init is empty"):
        sft_stage(sft_cfg(cfg, "", data), tmp_path / "a", progress=False)
    # a checkpoint made with another tokenizer than tokenizer.dir
    texts = [p.read_text() for p in sorted(tiny_corpus.glob("*.py"))]
    other = train_tokenizer(texts, 320, tmp_path / "other_tok", show_progress=False)
    bad = replace(sft_cfg(cfg, init_ckpt, data), tokenizer=replace(cfg.tokenizer, dir=str(other.folder)))
    with pytest.raises(ContractError, match="contract mismatch"):
        sft_stage(bad, tmp_path / "b", progress=False)
    # bad data: the CLI prints one error line naming file and line, exit 2
    bad_data = write_jsonl(tmp_path / "bad.jsonl", [OPENAI[1], {"messages": [{"role": "user", "content": "x"}]}])
    code = cli.main(["sft", "--out", str(tmp_path / "c"), "--set", f"sft.init={init_ckpt}",
                     "--set", f"sft.data={bad_data}", "--set", f"tokenizer.dir={tok.folder}", "--no-progress"])
    assert code == 2
    assert not (tmp_path / "c" / "metrics.jsonl").exists()


def test_sft_dry_run_writes_nothing(tiny_run, init_ckpt, tmp_path):
    cfg, tok = tiny_run
    data = write_jsonl(tmp_path / "chat.jsonl", many_conversations(10))
    res = sft_stage(sft_cfg(cfg, init_ckpt, data), tmp_path / "dry", dry_run=True, progress=False)
    assert res["dry_run"] and np.isfinite(res["loss"])
    assert not (tmp_path / "dry").exists()


@pytest.mark.slow
def test_sft_stage_on_the_stdlib_set(tiny_run, init_ckpt, tmp_path):
    cfg, tok = tiny_run
    cfg = sft_cfg(cfg, init_ckpt, "stdlib", steps=2, max_examples=16, val_examples=8, max_chars=200)
    cfg = replace(cfg, data=replace(cfg.data, val_fraction=0.02, seq_len=128))
    last = sft_stage(cfg, tmp_path / "sft", progress=False)
    assert np.isfinite(last["val_loss"])
    info = json.loads((tmp_path / "sft" / SFT_DATA_FILE).read_text())
    assert info["splits"]["train"]["conversations"] == 16 and 0 < info["splits"]["val"]["conversations"] <= 8
    assert info["splits"]["train"]["kept"] > 0
    val = [json.loads(x) for x in (tmp_path / "sft" / SFT_VAL_FILE).read_text().splitlines()]
    assert all(split_of(r["name"].split(":")[0], 0.02) == "val" for r in val)
    assert all(set(r) == {"name", "messages", "signature", "body"} for r in val)


# -- chat -----------------------------------------------------------------------------------------
def test_chat_cli_renders_history_and_stops_at_exit(init_ckpt, monkeypatch, capsys):
    from lmforge.runtime import decode_runtime
    from lmforge.stages import generate as sft_mod
    from lmforge.tokenizer import Tokenizer

    tok = Tokenizer.load(init_ckpt)
    seen = []
    replies = iter(["first reply", "second reply"])

    def fake_generate(model, prompts, stop_ids, sampling, pad_id, truncate=False, generator=None, runtime=None):
        assert runtime == decode_runtime()  # the command's decoding runtime, passed down
        seen.append((list(prompts[0]), list(stop_ids), sampling.max_new_tokens, sampling.greedy))
        return [tok.encode(next(replies)) + [tok.im_end_id]]

    monkeypatch.setattr(sft_mod, "generate", fake_generate)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\nsecond turn\n/exit\nnever read\n"))
    code = cli.main(["chat", "--checkpoint", str(init_ckpt), "--max-new-tokens", "7", "--greedy",
                     "--system", "be brief"])
    assert code == 0
    assert capsys.readouterr().out.splitlines() == ["first reply", "second reply"]
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    assert seen[0] == (tok.render_chat(history, add_generation_prompt=True).ids,
                       [tok.im_end_id, tok.eos_id], 7, True)
    history += [{"role": "assistant", "content": "first reply"}, {"role": "user", "content": "second turn"}]
    assert seen[1][0] == tok.render_chat(history, add_generation_prompt=True).ids
    assert len(seen) == 2


def test_chat_prompt_drops_the_oldest_turns_to_fit(tiny_tokenizer):
    tok = tiny_tokenizer
    msgs = [{"role": "system", "content": "sys"}]
    for i in range(4):
        msgs += [{"role": "user", "content": f"question {i} " * 5}, {"role": "assistant", "content": "answer " * 5}]
    msgs.append({"role": "user", "content": "last"})
    full = tok.render_chat(msgs, add_generation_prompt=True).ids
    assert chat_prompt(tok, msgs, len(full)) == full
    short = chat_prompt(tok, msgs, len(full) - 1)
    kept = [msgs[0]] + msgs[3:]  # the oldest exchange went first, the system message stays
    assert short == tok.render_chat(kept, add_generation_prompt=True).ids
    tiny = chat_prompt(tok, msgs, 5)
    assert tiny == tok.render_chat([msgs[0], msgs[-1]], add_generation_prompt=True).ids


def test_chat_loop_reset_and_eof(init_ckpt):
    model, _, _, _ = load_model(init_ckpt)
    from lmforge.generate import SamplingConfig
    from lmforge.tokenizer import Tokenizer

    tok = Tokenizer.load(init_ckpt)
    lines = iter(["one\n", "/reset\n", "\n", "two\n"])
    out = []
    history = chat_loop(model, tok, SamplingConfig(max_new_tokens=3, greedy=True), lambda: next(lines, None),
                        out.append)
    assert len(out) == 2 and [m["content"] for m in history if m["role"] == "user"] == ["two"]
    assert history[-1] == {"role": "assistant", "content": out[1]}


@pytest.mark.slow
def test_chat_subprocess_reads_stdin_until_eof(init_ckpt):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-m", "lmforge", "chat", "--checkpoint", str(init_ckpt),
                           "--max-new-tokens", "4", "--greedy"], input="hello\nagain\n", capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr


def test_body_parse_rate_counts_bodies_that_parse(tiny_tokenizer, monkeypatch):
    from lmforge.scorers import python_bodies as sft_mod

    tok = tiny_tokenizer
    items = [{"name": f"m:f{i}", "signature": f"def f{i}(x):",
              "messages": [{"role": "user", "content": STDLIB_PROMPT + f"def f{i}(x):"}]} for i in range(3)]
    # parses; not indented; unbalanced; valid Python but cut off by the budget (no end of turn)
    bodies = iter(["    return x", "return x", "    if x:\n        return (x", "    return self._w, self._"])
    ends = iter([True, True, True, False])
    items.append(dict(items[0], name="m:f3"))

    def fake_generate(model, prompts, stop_ids, sampling, pad_id, truncate=False, generator=None, runtime=None):
        assert sampling.greedy and list(stop_ids) == [tok.im_end_id, tok.eos_id]
        return [tok.encode(next(bodies)) + ([tok.im_end_id] if next(ends) else []) for _ in prompts]

    monkeypatch.setattr(sft_mod, "generate", fake_generate)
    res = body_parse_rate(None, tok, items, max_new_tokens=8)
    assert (res["parsed"], res["stopped"], res["n"]) == (1, 3, 4) and res["fraction"] == 0.25
    assert [e["parses"] for e in res["examples"]] == [True, False, False, False]
    assert res["examples"][0]["body"] == "    return x"
