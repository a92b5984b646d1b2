"""Conversations: reading and validating them, splitting, and rendering them to rows.

Sources (`sft.data`):

- a `.jsonl` file (one JSON object a line) or a `.parquet` file (one row a record), each
  record in one of three common shapes, detected per record:
    OpenAI    {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
    ShareGPT  {"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}
              ("user"/"assistant" are accepted in `from` as well)
    Alpaca    {"instruction": str, "input": str (optional), "output": str}
              -> user: instruction, plus "\\n\\n" + input when input is not empty;
                 assistant: output
  A record with the keys of more than one shape ("messages" and "conversations", or either
  with Alpaca's "instruction"/"output") is refused: no shape is taken over another in silence.
  A conversation must end on an assistant turn. Bad input is a `DataError` naming the
  file and line (JSONL) or row (Parquet, 1-based), the value seen and the value expected.
- "stdlib": the embedded default set (`lmforge.data.stdlib_functions`).

Train / validation split: by `lmforge.data.sources.split_of(key, data.val_fraction)`, the
rule pretraining uses. For the standard library the key is the module name, exactly as in
pretraining, so a module held out of pretraining is held out of SFT too (no validation
module leaks into training). For files the key is a hash of the conversation's content.

Rows (`render_samples`, `sft_stream`, `sft_batches`): every conversation is one sample
(one document), rendered with `Tokenizer.render_chat` (ChatML; the learn mask covers each
assistant turn's content and its `<|im_end|>`). Length policy: a conversation longer than
`seq_len` (input, target) pairs keeps its first `seq_len + 1` tokens (the tail is
truncated; counted as `truncated`); if that cut removes every supervised target, the
conversation is dropped instead (counted as `dropped_all_cut`, not as `truncated`). The
same policy holds for both row layouts, so a conversation never spans two rows and no
piece of one is trained without its prompt:
- right-padded (default): one conversation per row, padding on the right, no attention
  mask (plain causal attention: safe because padding is on the right);
- packed (`sft.packing = true`): several conversations per row with document masking
  (each attends only to itself; positions restart at 0).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmforge.data.packing import Batch, RowStream
from lmforge.data.records import check_text, content_key, read_items, short
from lmforge.data.sources import split_of
from lmforge.errors import DataError

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant"}
SHAPES_HELP = ('expected one of: {"messages": [{"role", "content"}, ...]} (OpenAI), '
               '{"conversations": [{"from", "value"}, ...]} (ShareGPT), '
               '{"instruction", "input", "output"} (Alpaca)')

#: The keys of each shape, for the refusal of a record of several: a shape is present when one of
#: its keys but Alpaca's optional "input" is (`shapes_of`).
SHAPE_KEYS = (("OpenAI", ("messages",)), ("ShareGPT", ("conversations",)),
              ("Alpaca", ("instruction", "input", "output")))


@dataclass(frozen=True)
class Conversation:
    """A validated conversation: `messages` are {"role", "content"} dicts, roles in ROLES,
    the last one "assistant"."""

    messages: tuple[dict, ...]
    name: str
    """Where it came from: `file:line`, `file#row` or `module:qualname`."""
    key: str
    """What the train/validation split is decided on."""


# -- files -------------------------------------------------------------------------------
def _speaker(turn: object, where: str, key: str, choices: Sequence[str], text_key: str, seen_as: str) -> str:
    """`turn[key]` (who speaks: an OpenAI "role", a ShareGPT "from") when `turn` is an object
    holding it with a value in `choices`.

    Raises:
        DataError naming `where` (file:line and the turn), the keys or value seen, and `choices`.
    """
    if not isinstance(turn, dict) or key not in turn:
        keys = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
        raise DataError(f"{where} has no \"{key}\" (keys: {keys}); expected {{\"{key}\": one of {choices}, "
                        f"\"{text_key}\": str}}. Fix or remove the record.")
    if not isinstance(turn[key], str) or turn[key] not in choices:  # a list or an object is never a speaker
        raise DataError(f"{where} has {seen_as} {short(turn[key])}; expected one of {choices}. Rename it or "
                        f"remove the record.")
    return turn[key]


def validate_messages(messages: object, where: str, require_reply: bool = True) -> tuple[dict, ...]:
    """Check an OpenAI-style message list and return it as clean {"role", "content"} dicts.
    `require_reply=False` (a prompt to answer, as `lmforge serve` gets) accepts any last turn.

    Raises:
        DataError (naming `where`): not a non-empty list; a message without "role" or
        "content"; an unknown role; content that is not a string (or holds a lone
        surrogate); with `require_reply`, a conversation that does not end on an assistant turn.
    """
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects, "
                        f"got {short(messages)}. Fix or remove the record.")
    out = []
    for i, m in enumerate(messages):
        role = _speaker(m, f"{where}: message {i}", "role", ROLES, "content", "role")
        content = check_text(m.get("content"), where, f"message {i} ({role}) content")
        out.append({"role": role, "content": content})
    if require_reply and out[-1]["role"] != "assistant":
        raise DataError(f"{where}: the conversation ends on a {out[-1]['role']!r} turn (message {len(out) - 1}); "
                        f"expected it to end on an 'assistant' turn, the reply to learn. Add the reply or "
                        f"drop the trailing turn.")
    return tuple(out)


def conversation_from_record(record: object, where: str) -> Conversation:
    """Detect the record's shape (OpenAI / ShareGPT / Alpaca) and validate it.

    Raises:
        DataError naming `where` (file:line) for any malformed record.
    """
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}; {SHAPES_HELP}.")
    shapes = shapes_of(record)
    if len(shapes) > 1:  # none may win: the record would be trained as a conversation it may not be
        held = ", ".join(f"{name} ({', '.join(map(repr, keys))})" for name, keys in shapes)
        raise DataError(f"{where}: the record holds keys of more than one form: {held}; a record is one of them, "
                        f"{SHAPES_HELP}. Remove the other form's keys.")
    if "messages" in record:
        messages = validate_messages(record["messages"], where)
    elif "conversations" in record:
        turns = record["conversations"]
        if not isinstance(turns, list) or not turns:
            raise DataError(f"{where}: \"conversations\" must be a non-empty list of {{\"from\", \"value\"}} "
                            f"objects, got {short(turns)}.")
        converted = []
        for i, t in enumerate(turns):
            speaker = _speaker(t, f"{where}: turn {i}", "from", sorted(SHAREGPT_ROLES), "value", '"from" =')
            converted.append({"role": SHAREGPT_ROLES[speaker], "content": t.get("value")})
        messages = validate_messages(converted, where)
    elif "instruction" in record or "output" in record:
        instruction, inp, output = record.get("instruction"), record.get("input", ""), record.get("output")
        for name, value in (("instruction", instruction), ("output", output)):
            if not isinstance(value, str):
                raise DataError(f"{where}: Alpaca field \"{name}\" is {short(value)}; expected a string.")
        if inp is None:
            inp = ""
        if not isinstance(inp, str):
            raise DataError(f"{where}: Alpaca field \"input\" is {short(inp)}; expected a string (or absent).")
        user = instruction + ("\n\n" + inp if inp else "")
        messages = validate_messages([{"role": "user", "content": user},
                                      {"role": "assistant", "content": output}], where)
    else:
        raise DataError(f"{where}: unknown record shape with keys {sorted(record)}; {SHAPES_HELP}.")
    return Conversation(messages, where, content_key([[m["role"], m["content"]] for m in messages]))


def shapes_of(record: dict) -> list[tuple[str, list[str]]]:
    """The shapes (SHAPE_KEYS) whose keys `record` holds, each with the keys it holds; Alpaca's
    "input" alone (beside "messages", say) makes no Alpaca record."""
    out = []
    for name, keys in SHAPE_KEYS:
        held = [k for k in keys if k in record]
        if held and held != ["input"]:
            out.append((name, held))
    return out


def read_conversations(path: str | Path) -> list[Conversation]:
    """Every conversation of a `.jsonl` or `.parquet` file, validated, in file order.

    Raises:
        DataError: a missing file, another suffix, invalid JSON, a malformed record (naming
        the file and line / row), or a file with no records.
    """
    return read_items(path, "sft.data", "conversations", conversation_from_record,
                      f"add records ({SHAPES_HELP}) or point sft.data at another file")


def cap_examples(items: Sequence, limit: int, key: Callable[[object], str]) -> list:
    """At most `limit` items (0 = all), chosen by a stable hash of `key(item)` so the choice
    spreads over every module; the result keeps the input order."""
    if not limit or len(items) <= limit:
        return list(items)
    ranked = sorted(range(len(items)), key=lambda i: hashlib.sha256(key(items[i]).encode("utf-8")).digest())
    chosen = set(ranked[:limit])
    return [x for i, x in enumerate(items) if i in chosen]


def split_conversations(convs: Sequence[Conversation], val_fraction: float) -> dict[str, list[Conversation]]:
    """{"train", "val"} by split_of(conversation.key, val_fraction), order kept."""
    out: dict[str, list[Conversation]] = {"train": [], "val": []}
    for c in convs:
        out[split_of(c.key, val_fraction)].append(c)
    return out


# -- rows ------------------------------------------------------------------------------------
@dataclass
class SFTSamples:
    """Rendered conversations: `ids[i]` (L_i,) int64 tokens, `learn[i]` (L_i,) bool learn flags
    (True on assistant content and its <|im_end|>), `names[i]` where each came from.
    Counts: `conversations` read, `truncated` (cut to seq_len + 1 tokens and kept),
    `dropped_all_cut` (cut, and nothing left to learn: not kept), `supervised` (targets
    kept), `tokens` (kept)."""

    ids: list[np.ndarray]
    learn: list[np.ndarray]
    names: list[str]
    conversations: int = 0
    truncated: int = 0
    dropped_all_cut: int = 0
    supervised: int = 0
    tokens: int = 0

    @property
    def n_pairs(self) -> np.ndarray:
        return np.array([len(x) - 1 for x in self.ids], dtype=np.int64)

    def counts(self) -> dict:
        return {"conversations": self.conversations, "kept": len(self.ids), "truncated": self.truncated,
                "dropped_all_cut": self.dropped_all_cut, "tokens": self.tokens, "supervised": self.supervised}

    def get_tokens(self, s: int, start: int, stop: int) -> np.ndarray:
        return self.ids[s][start:stop]

    def get_learn(self, s: int, start: int, stop: int) -> np.ndarray:
        return self.learn[s][start:stop]


def render_samples(convs: Sequence[Conversation], tokenizer, seq_len: int) -> SFTSamples:
    """Render each conversation with the chat template and apply the length policy (module
    docstring): keep the first seq_len + 1 tokens; drop it if no supervised target is left."""
    out = SFTSamples([], [], [])
    for c in convs:
        out.conversations += 1
        r = tokenizer.render_chat(c.messages)
        ids = np.asarray(r.ids, dtype=np.int64)
        learn = np.asarray(r.loss_mask, dtype=bool)
        cut = len(ids) - 1 > seq_len
        if cut:
            ids, learn = ids[: seq_len + 1], learn[: seq_len + 1]
        n_learn = int(learn[1:].sum())  # the first token is never a target
        if n_learn == 0:
            out.dropped_all_cut += 1  # (only a cut can do this: a conversation ends on a learned <|im_end|>)
            continue
        out.truncated += cut
        out.ids.append(ids)
        out.learn.append(learn)
        out.names.append(c.name)
        out.supervised += n_learn
        out.tokens += len(ids)
    return out


def sft_stream(samples: SFTSamples, seq_len: int, micro_batch_size: int, pad_id: int, seed: int,
               packing: bool = False, shuffle: bool = True, rank: int = 0, world_size: int = 1) -> RowStream:
    """An endless, resumable RowStream over the samples: right-padded one per row without an
    attention mask (`packing=False`), or packed with document masking (`packing=True`).

    Raises:
        DataError: no sample to train on.
    """
    if not samples.ids:
        raise DataError(f"no SFT conversation left to train on ({samples.counts()}). Use longer data.seq_len "
                        f"or shorter conversations.")
    return RowStream(samples.n_pairs, samples.get_tokens, samples.get_learn, seq_len, micro_batch_size, pad_id,
                     seed, packing=packing, document_masking=packing, shuffle=shuffle, rank=rank,
                     world_size=world_size)


def sft_batches(samples: SFTSamples, seq_len: int, batch_size: int, pad_id: int,
                packing: bool = False) -> Iterator[Batch]:
    """Every sample once, in order (validation); the last batch may be short."""
    if not samples.ids:
        return iter(())
    return sft_stream(samples, seq_len, batch_size, pad_id, seed=0, packing=packing, shuffle=False).batches_once()


__all__ = ["Conversation", "SFTSamples", "ROLES", "validate_messages", "conversation_from_record",
           "read_conversations", "cap_examples", "split_conversations", "render_samples", "sft_stream",
           "sft_batches"]
