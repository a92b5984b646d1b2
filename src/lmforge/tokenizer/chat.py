"""The chat template: a Hugging Face (Jinja) chat template rendered as `transformers` renders
it, and a conversation rendered to ids with its assistant-only loss mask."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass

import lmforge  # the annotation of `ChatTemplate.render_ids` (importing lmforge.tokenizer here would be a cycle)
from lmforge.errors import ContractError, DataError


@dataclass
class ChatRendering:
    """A conversation rendered to ids. `loss_mask[i]` is 1 where ids[i] is an assistant
    token to be learned (its content and its <|im_end|>), 0 elsewhere."""

    ids: list[int]
    loss_mask: list[int]


#: The conversation a template is probed with (its turn end, its prefix property, its close).
PROBE_CHAT = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
              {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye"})


def conversation_close(upto: str, text: str, tokens) -> str | None:
    """What a template writes only where a conversation ends, given the rendering `upto` of a
    conversation's first turns and the rendering `text` of the whole: one of the special-token
    strings `tokens` (the template's variables: Phi-3 ends with its eos_token when no generation
    prompt is asked) that both end with, `upto` without it being a prefix of `text`. "" when
    `upto` is itself a prefix of `text` (most templates); None otherwise (a template that rewrites
    earlier turns)."""
    if text.startswith(upto):
        return ""
    for token in sorted({t for t in tokens if isinstance(t, str) and t}, key=len, reverse=True):
        if upto.endswith(token) and text.endswith(token) and text.startswith(upto[:-len(token)]):
            return token
    return None


class ChatTemplate:
    """A Hugging Face chat template (Jinja), rendered the way `transformers`' apply_chat_template
    renders it: a sandboxed environment with trim_blocks and lstrip_blocks, loop controls,
    `raise_exception`, `tojson` (no HTML escaping), `strftime_now`, a `{% generation %}` block
    that renders its body, and the tokenizer's special-token strings as variables; the
    rendered string is then tokenized as one piece with special tokens recognised.

    Assistant spans (the loss mask) come from prefix renderings: for the assistant message i,
    P = render(messages[:i], add_generation_prompt=True) and Q = render(messages[:i+1]) must
    satisfy P ⊑ Q ⊑ render(messages) (string prefixes); the span is Q[len(P):] up to and
    including its last end-of-turn token (the contract's im_end). Tokens overlapping the span
    are learned (transformers' rule for `return_assistant_tokens_mask`). A template that breaks
    the prefix property (one that rewrites earlier turns) is refused, never approximated. Text
    a template adds only where a conversation ends (Phi-3's eos_token without a generation
    prompt: `conversation_close`) is not part of Q for this rule, and never learned.
    """

    def __init__(self, source: str, variables: dict[str, str], name: str):
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(Extension):  # {% generation %}...{% endgeneration %}: its body, as rendered
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt):
            import datetime

            return datetime.datetime.now().strftime(fmt)

        self.name, self.variables = name, dict(variables)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        self._errors = (jinja2.exceptions.TemplateError,)
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ContractError(f"{name}: the chat template does not compile ({exc}). Fix the template.") from None

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for `messages`.

        Raises:
            DataError: the template raised (its own message is quoted) or failed to render.
        """
        try:
            return self.template.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **self.variables)
        except self._errors as exc:
            raise DataError(f"{self.name} refuses this conversation ({exc}); roles "
                            f"{[m.get('role') for m in messages]}. Change the conversation to the form the "
                            f"model's template accepts.") from None

    @functools.cached_property
    def close(self) -> str:
        """What the template writes only where a conversation ends (`conversation_close` of the
        probe chat: Phi-3's eos_token; "" for most templates, and for one the probe cannot render)."""
        try:
            return conversation_close(self.render(PROBE_CHAT[:2]), self.render(PROBE_CHAT),
                                      self.variables.values()) or ""
        except DataError:
            return ""

    def render_ids(self, tok: "lmforge.tokenizer.Tokenizer", messages: Sequence[dict],
                   add_generation_prompt: bool) -> ChatRendering:
        """ids (tokenized as transformers does) and the assistant-only loss mask (class docstring)."""
        specials = [a.content for a in tok.hf.get_added_tokens_decoder().values() if a.special]
        for i, m in enumerate(messages):
            found = [t for t in specials if t in m["content"]]
            if found:
                raise DataError(
                    f"message {i} ({m['role']}) spells the special token {found[0]!r}; the model's chat template "
                    f"({self.name}) would turn it into the real token, as transformers does. Remove it from the text.")
        text = self.render(messages, add_generation_prompt)
        enc = tok.chat_encoder().encode(text, add_special_tokens=False)
        mask = [0] * len(enc.ids)
        turn_end = tok.spellings["im_end"]
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            core = upto[:len(upto) - len(self.close)] if self.close and upto.endswith(self.close) else upto
            if not (upto.startswith(prompt) and text.startswith(core)):
                raise DataError(
                    f"{self.name} cannot be rendered faithfully: the rendering of the conversation up to message "
                    f"{i} is not a prefix of the rendering of the next turns (the template changes earlier turns, "
                    f"or renders the generation prompt differently from a reply). lmforge trains only on templates "
                    f"whose turns render independently; use another template (--set in tokenizer_config.json).")
            end = core.rfind(turn_end, len(prompt))
            if end < 0:
                raise DataError(f"{self.name}: the assistant message {i} renders without the end-of-turn token "
                                f"{turn_end!r}; the model could not learn to stop. Use another template.")
            start, end = len(prompt), end + len(turn_end)
            inside = [t for t, (a, b) in enumerate(enc.offsets) if a < end and b > start]
            for t in range(inside[0], inside[-1] + 1) if inside else ():  # contiguous: trimmed offsets too
                mask[t] = 1
        return ChatRendering(list(enc.ids), mask)
