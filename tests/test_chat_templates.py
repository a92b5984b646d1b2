"""An imported model's own chat template drives SFT and chat, exactly as `transformers` renders it.

For each family's real public template (`hf_families`: SmolLM2's ChatML with its default system
prompt, Qwen2.5's ChatML, Llama 3's headers, Mistral's [INST]), on a tokenizer built locally and
imported: `Tokenizer.render_chat` gives `apply_chat_template`'s ids, with and without the
generation prompt; SFT rows are those ids; the loss mask covers exactly each assistant reply and
its end-of-turn token (checked by decoding the learned targets, and against transformers'
`return_assistant_tokens_mask` for a template with `{% generation %}` blocks). A template that
rewrites earlier turns (Qwen3's thinking template) is refused by name.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from hf_families import QWEN3_THINKING_TEMPLATE, build_tokenizer  # noqa: E402

from lmforge.data.conversations import Conversation, render_samples  # noqa: E402
from lmforge.errors import ContractError, DataError  # noqa: E402
from lmforge.tokenizer import CHAT_TEMPLATE, import_tokenizer  # noqa: E402

CHATS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "    return a + b\n"},
     {"role": "user", "content": "  and café?\n\n"}, {"role": "assistant", "content": "12345 fox"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Hi"}],
]
#: family -> the text an assistant reply is learned as (content, then the end-of-turn token)
LEARNED = {
    "smollm": lambda c: c + "<|im_end|>",
    "qwen2": lambda c: c + "<|im_end|>",
    "llama3": lambda c: c.strip() + "<|eot_id|>",  # Llama 3's template trims each message
    "mistral": lambda c: c + "</s>",
    "phi3": lambda c: c + "<|end|>",  # its closing eos_token (no generation prompt) is never learned
}


@pytest.fixture(scope="module", params=sorted(LEARNED))
def family_tok(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    fast = build_tokenizer(request.param, tmp / "hf")
    return request.param, fast, import_tokenizer(tmp / "hf", tmp / "tok")


def chats_for(family):
    # Mistral's template refuses a system message (its own raise_exception)
    return [c for c in CHATS if family != "mistral" or c[0]["role"] != "system"]


def test_ids_equal_apply_chat_template(family_tok):
    family, fast, tok = family_tok
    assert tok.contract.chat_template != CHAT_TEMPLATE
    for messages in chats_for(family):
        for gen in (False, True):
            prompt = messages[:-1] if gen else messages
            want = list(fast.apply_chat_template(prompt, tokenize=True, add_generation_prompt=gen, return_dict=False))
            assert tok.render_chat(prompt, add_generation_prompt=gen).ids == want, (family, gen, prompt)
        samples = render_samples([Conversation(tuple(messages), "t", "t")], tok, 10_000)
        want = list(fast.apply_chat_template(messages, tokenize=True, return_dict=False))
        assert samples.ids[0].tolist() == want


def test_mask_is_each_reply_and_its_end_of_turn(family_tok):
    family, fast, tok = family_tok
    for messages in chats_for(family):
        r = tok.render_chat(messages)
        learned = tok.decode([i for i, m in zip(r.ids, r.loss_mask) if m])
        want = "".join(LEARNED[family](m["content"]) for m in messages if m["role"] == "assistant")
        if family == "phi3":  # <|assistant|> strips the whitespace after it (rstrip), a reply's leading spaces
            learned = learned.replace("<|assistant|>", "")  # included: it overlaps the reply, so it is learned
            want = "".join(LEARNED[family](m["content"].lstrip()) for m in messages if m["role"] == "assistant")
        # equal, up to the prompt's last whitespace when BPE merges it with a reply that starts with
        # whitespace (one token spans both; it is learned, as transformers' generation mask does)
        assert "".join(learned.split()) == "".join(want.split()) and 0 <= len(learned) - len(want) <= 2, \
            (family, learned, want)
        if not any(m["content"][:1].isspace() for m in messages if m["role"] == "assistant"):
            assert learned == want
        # the last learned token closes the last reply: the model learns to stop
        last = max(i for i, m in enumerate(r.loss_mask) if m)
        assert r.ids[last] == tok.im_end_id


def test_mask_equals_transformers_generation_mask(tmp_path):
    template = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
                "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
                "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    fast = build_tokenizer("qwen2", tmp_path / "hf", template=template)
    tok = import_tokenizer(tmp_path / "hf", tmp_path / "tok")
    for messages in CHATS:
        out = fast.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        r = tok.render_chat(messages)
        assert r.ids == list(out["input_ids"]) and r.loss_mask == list(out["assistant_masks"])
        assert sum(r.loss_mask) > 0


def test_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    build_tokenizer("qwen3", tmp_path / "hf", template=QWEN3_THINKING_TEMPLATE)
    with pytest.raises(ContractError, match="cannot be rendered faithfully"):
        import_tokenizer(tmp_path / "hf", tmp_path / "tok")
    assert not (tmp_path / "tok").exists()


def test_template_errors_and_special_spellings_are_data_errors(family_tok):
    family, _, tok = family_tok
    with pytest.raises(DataError, match="spells the special token"):
        tok.render_chat([{"role": "user", "content": f"a {tok.spellings['im_end']} b"},
                         {"role": "assistant", "content": "ok"}])
    if family == "mistral":
        with pytest.raises(DataError, match="roles must alternate"):
            tok.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_conversation_close_is_the_text_only_a_conversations_end_gets():
    """Phi-3's template writes its eos_token after the last message when no generation prompt is
    asked: that text is the close; a template that rewrites earlier turns has none (None)."""
    from lmforge.tokenizer.chat import conversation_close

    tokens = ("<EOS>", "<u>", "")
    assert conversation_close("<u>hi<a>yo<e>\n", "<u>hi<a>yo<e>\n<u>bye", tokens) == ""
    assert conversation_close("<u>hi<a>yo<e>\n<EOS>", "<u>hi<a>yo<e>\n<u>bye<a>ok<e>\n<EOS>", tokens) == "<EOS>"
    assert conversation_close("<u>hi<a>yo<e>\n<EOS>", "<u>hi<a>yo<e>\n<u>bye<a>ok<e>\n<EOS>", ("<u>",)) is None
    assert conversation_close("<u>hi<a><think>x</think>yo<e>\n", "<u>hi<a>yo<e>\n<u>bye<a>ok<e>\n", tokens) is None
