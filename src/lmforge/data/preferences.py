"""Preference pairs for DPO: reading them, rendering them in token space, and their rows.

Records (`dpo.data`, a `.jsonl` or `.parquet` file; one pair a record), in TRL's two forms
(huggingface/trl docs/source/dataset_formats.md, "preference"):

    explicit  {"prompt": str | messages, "chosen": str | messages, "rejected": str | messages}
              a string prompt is one user turn; a string answer is one assistant turn; a
              message list of an answer holds exactly one assistant message
    implicit  {"chosen": messages, "rejected": messages}
              two whole conversations that share every turn but the last (minimind's and
              torchtune's form)

`messages` are OpenAI-style [{"role", "content"}] lists (as in SFT data). Other keys are
ignored, except `mutation` (a string: the kind of difference, reported per kind by the
held-out accuracy) and `name`. A `DataError` names the file and line for: prompts that
differ between chosen and rejected, a last turn that is not the assistant's, chosen ==
rejected, or any malformed field.

Rendering (`render_pairs`): each side is rendered whole with the tokenizer's chat template
(`Tokenizer.render_chat`, the SFT path: lmforge's ChatML or the model's own template). The
completion mask is the learn mask of the *final* assistant turn only: its content and its
end-of-turn token (the last run of learned tokens). The prompt, every token before that
run, must be the same ids on both sides (checked: a template whose turn header merges with
the answer's first characters would compare different contexts). Length policy as SFT's:
a side longer than `seq_len` pairs keeps its first `seq_len + 1` tokens; a pair whose
completion is cut away entirely on either side is dropped and counted (`dropped_empty`),
never trained (its loss would be a constant ln 2).

Rows (`PairStream`): the stream deals *pairs* exactly as `RowStream` deals samples (epochs,
ranks and resume included) and turns each micro-batch of B pairs into a `PairBatch` whose one
forward scores both sides of every pair. Its 2B sides are the groups 0..B-1 (chosen) and
B..2B-1 (rejected), and every slot names its side in `groups`:
- padded (`packing=False`): 2B rows, side j right-padded alone in row j (causal attention);
- packed (`packing=True`, `dpo.packing`'s default): the 2B sides packed into as few rows of
  `seq_len` as best fit (longest first) finds, each side its own attention segment with
  positions from 0 (`lmforge.data.packing.build_row`), so each side sees only itself exactly as
  alone in a row. A micro-batch holds the same pairs either way, so the loss, its count and the
  step are the same (up to float rounding); only the padding goes. Rows per micro-batch vary
  (at most 2B).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lmforge.data.conversations import cap_examples, validate_messages
from lmforge.data.packing import FIELDS, Batch, Piece, RowStream, build_row, collate, plan_packed
from lmforge.data.records import check_text, content_key, read_items, short
from lmforge.data.sources import split_of
from lmforge.errors import DataError

FORMS_HELP = ('expected {"prompt": str | messages, "chosen": str | messages, "rejected": str | messages} '
              '(explicit) or {"chosen": messages, "rejected": messages} (implicit: two conversations that '
              'differ only in the last assistant turn)')


@dataclass(frozen=True)
class PreferencePair:
    """A validated pair: `prompt` (messages, the last one not the assistant's), and the two
    final assistant replies."""

    prompt: tuple[dict, ...]
    chosen: str
    rejected: str
    name: str
    """Where it came from: `file:line`, or `module:qualname` for the embedded set."""
    key: str
    """What the train/validation split is decided on (the prompt: one prompt never lands in both)."""
    mutation: str = ""
    """The kind of difference, when the data says (held-out accuracy is reported per kind)."""

    def messages(self, side: str) -> tuple[dict, ...]:
        reply = self.chosen if side == "chosen" else self.rejected
        return self.prompt + ({"role": "assistant", "content": reply},)


def _reply(value: object, where: str, field: str) -> str:
    if isinstance(value, str):
        return check_text(value, where, field)
    messages = validate_messages(value, f"{where}: {field}")
    if len(messages) != 1:
        raise DataError(f"{where}: {field} holds {len(messages)} messages; expected one assistant message (the "
                        f"reply), the turns before it belong in \"prompt\". Fix or remove the record.")
    return messages[0]["content"]


def pair_from_record(record: object, where: str) -> PreferencePair:
    """Validate one record (either form, module docstring).

    Raises:
        DataError naming `where` (file:line), the field and what was expected.
    """
    if not isinstance(record, dict) or "chosen" not in record or "rejected" not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where}: a preference record with keys {keys}; {FORMS_HELP}. Fix or remove the record.")
    if "prompt" in record:
        prompt = record["prompt"]
        if isinstance(prompt, str):
            prompt = ({"role": "user", "content": check_text(prompt, where, "prompt")},)
        else:
            prompt = validate_messages(prompt, f"{where}: prompt", require_reply=False)
            if prompt[-1]["role"] == "assistant":
                raise DataError(f"{where}: the prompt ends on an 'assistant' turn; the reply to compare must be the "
                                f"last turn. Move it into \"chosen\"/\"rejected\" or drop it.")
        chosen = _reply(record["chosen"], where, "chosen")
        rejected = _reply(record["rejected"], where, "rejected")
    else:
        sides = {}
        for side in ("chosen", "rejected"):
            msgs = validate_messages(record[side], f"{where}: {side}", require_reply=False)
            if msgs[-1]["role"] != "assistant":
                raise DataError(f"{where}: {side} ends on a {msgs[-1]['role']!r} turn; expected the last turn to "
                                f"be the assistant's reply being compared. Fix or remove the record.")
            if len(msgs) < 2:
                raise DataError(f"{where}: {side} holds only the assistant's reply; the implicit form needs the "
                                f"prompt turns before it (or use the explicit form with \"prompt\").")
            sides[side] = msgs
        prompt = sides["chosen"][:-1]
        if sides["rejected"][:-1] != prompt:
            first = next((i for i, (a, b) in enumerate(zip(prompt, sides["rejected"][:-1])) if a != b),
                         min(len(prompt), len(sides["rejected"]) - 1))
            raise DataError(f"{where}: the prompts of chosen and rejected differ (at message {first}); a pair "
                            f"compares two replies to one prompt, so every turn but the last must be the same.")
        chosen, rejected = sides["chosen"][-1]["content"], sides["rejected"][-1]["content"]
    if chosen == rejected:
        raise DataError(f"{where}: chosen and rejected are the same reply ({short(chosen)}); a pair must differ. "
                        f"Fix or remove the record.")
    mutation = record.get("mutation", "")
    if not isinstance(mutation, str):
        raise DataError(f"{where}: \"mutation\" is {short(mutation)}; expected a string (the kind of difference).")
    name = record.get("name") if isinstance(record.get("name"), str) else where
    return PreferencePair(tuple(prompt), chosen, rejected, name,
                          content_key([[m["role"], m["content"]] for m in prompt]), mutation)


def read_pairs(path: str | Path) -> list[PreferencePair]:
    """Every pair of a `.jsonl` or `.parquet` file, validated, in file order.

    Raises:
        DataError: a missing file, another suffix, a malformed record (file and line), no records.
    """
    return read_items(path, "dpo.data", "preference pairs", pair_from_record, FORMS_HELP)


def split_pairs(pairs: Sequence[PreferencePair], val_fraction: float) -> dict[str, list[PreferencePair]]:
    """{"train", "val"} by `split_of(pair.key, val_fraction)` (the prompt), order kept."""
    out: dict[str, list[PreferencePair]] = {"train": [], "val": []}
    for p in pairs:
        out[split_of(p.key, val_fraction)].append(p)
    return out


def cap_pairs(pairs: Sequence[PreferencePair], limit: int) -> list[PreferencePair]:
    return cap_examples(pairs, limit, lambda p: p.key + p.name)


# -- rendering -------------------------------------------------------------------------------
def final_turn_mask(learn: np.ndarray) -> np.ndarray:
    """The last run of learned tokens of a rendering (the final assistant turn: its content
    and end-of-turn token), as a bool mask of the same length."""
    out = np.zeros(len(learn), dtype=bool)
    idx = np.flatnonzero(learn)
    if len(idx) == 0:
        return out
    end = idx[-1]
    start = end
    while start > 0 and learn[start - 1]:
        start -= 1
    out[start: end + 1] = True
    return out


@dataclass
class PairSamples:
    """Rendered pairs: `ids[side][i]` (L,) int64 and `mask[side][i]` (L,) bool (the completion
    tokens), side "chosen" / "rejected"; `prompt_len[i]` (tokens before the completion, equal on
    both sides); `names`, `mutations`. Counts: `pairs` read, `truncated` (a side cut to
    seq_len + 1 tokens and kept), `dropped_empty` (a side's completion cut away: not kept)."""

    ids: dict[str, list[np.ndarray]]
    mask: dict[str, list[np.ndarray]]
    prompt_len: list[int]
    names: list[str]
    mutations: list[str]
    pairs: int = 0
    truncated: int = 0
    dropped_empty: int = 0

    def __len__(self) -> int:
        return len(self.names)

    @property
    def n_pairs(self) -> np.ndarray:
        """Per pair, the (input, target) pairs of its longer side (how the rows are planned)."""
        return np.array([max(len(c), len(r)) - 1 for c, r in zip(self.ids["chosen"], self.ids["rejected"])],
                        dtype=np.int64)

    def counts(self) -> dict:
        return {"pairs": self.pairs, "kept": len(self), "truncated": self.truncated,
                "dropped_empty": self.dropped_empty,
                "tokens": int(sum(len(x) for side in self.ids.values() for x in side)),
                "completion_tokens": int(sum(int(m[1:].sum()) for side in self.mask.values() for m in side))}


def render_pairs(pairs: Sequence[PreferencePair], tokenizer, seq_len: int) -> PairSamples:
    """Render both sides of every pair (module docstring) and apply the length policy.

    Raises:
        DataError: the prompt renders to different ids on the two sides (naming the pair), or
        the chat template refuses a conversation.
    """
    out = PairSamples({"chosen": [], "rejected": []}, {"chosen": [], "rejected": []}, [], [], [])
    for p in pairs:
        out.pairs += 1
        sides, cut = {}, False
        for side in ("chosen", "rejected"):
            r = tokenizer.render_chat(p.messages(side))
            ids = np.asarray(r.ids, dtype=np.int64)
            mask = final_turn_mask(np.asarray(r.loss_mask, dtype=bool))
            sides[side] = (ids, mask, int(np.argmax(mask)) if mask.any() else len(ids))
        (ci, cm, cp), (ri, rm, rp) = sides["chosen"], sides["rejected"]
        if cp != rp or not np.array_equal(ci[:cp], ri[:rp]):
            raise DataError(f"{p.name}: the prompt renders to different tokens before the chosen and the rejected "
                            f"reply ({cp} and {rp} tokens); the chat template's turn header merges with the replies' "
                            f"first characters, so the two would be scored in different contexts. Start both "
                            f"replies the same way (e.g. without leading whitespace).")
        kept = {}
        for side, (ids, mask, _) in sides.items():
            if len(ids) - 1 > seq_len:
                ids, mask, cut = ids[: seq_len + 1], mask[: seq_len + 1], True
            kept[side] = (ids, mask)
        if any(not m[1:].any() for _, m in kept.values()):  # the first token is never a target
            out.dropped_empty += 1
            continue
        out.truncated += cut
        for side, (ids, mask) in kept.items():
            out.ids[side].append(ids)
            out.mask[side].append(mask)
        out.prompt_len.append(cp)
        out.names.append(p.name)
        out.mutations.append(p.mutation)
    return out


# -- rows --------------------------------------------------------------------------------------
@dataclass
class PairBatch(Batch):
    """A micro-batch of P pairs (module docstring): `Batch`'s fields, (R, T) with R = 2P rows
    padded or at most 2P packed; `groups` (R, T) int64, each slot's side (chosen of pair k: k,
    rejected: P + k; padding: 0, outside the loss mask); `completion_tokens` (2P,) int64, each
    side's supervised targets in the same order; `pair_index` (P,) int64, each pair's index in
    its `PairSamples`."""

    groups: torch.Tensor | None = None
    completion_tokens: torch.Tensor | None = None
    pair_index: torch.Tensor | None = None

    @property
    def n_pairs(self) -> int:
        return int(self.pair_index.shape[0])

    def to(self, device: torch.device | str) -> "PairBatch":
        return PairBatch(*(getattr(self, f).to(device, non_blocking=True) for f in FIELDS),
                         groups=self.groups.to(device, non_blocking=True), completion_tokens=self.completion_tokens,
                         pair_index=self.pair_index)


class PairStream(RowStream):
    """An endless, resumable stream of `PairBatch`es over `samples` (module docstring): the
    pairs are dealt as `RowStream` deals samples (one pair a unit, seeded shuffle per epoch,
    ranks and `state_dict` alike); `packing` chooses how a micro-batch's pairs are laid out.

    Raises:
        DataError: no pair to train on.
    """

    def __init__(self, samples: PairSamples, seq_len: int, micro_batch_size: int, pad_id: int, seed: int,
                 shuffle: bool = True, rank: int = 0, world_size: int = 1, packing: bool = True):
        if not len(samples):
            raise DataError(f"no preference pair left to train on ({samples.counts()}). Use a longer data.seq_len "
                            f"or shorter pairs.")
        self.samples, self.pack_sides = samples, packing
        # the dealing unit is a pair, one per planned "row"; make_batch lays the micro-batch out
        super().__init__(samples.n_pairs, None, None, seq_len, micro_batch_size, pad_id, seed, packing=False,
                         document_masking=False, shuffle=shuffle, rank=rank, world_size=world_size)

    def layout(self, index: Sequence[int]) -> tuple[list[np.ndarray], list[np.ndarray], list[list[Piece]]]:
        """The sides of pairs `index` (ids and completion masks, side j = group j) and the rows
        they are laid out in (pieces (side, 0, its pairs))."""
        ids = [self.samples.ids[side][s] for side in ("chosen", "rejected") for s in index]
        mask = [self.samples.mask[side][s] for side in ("chosen", "rejected") for s in index]
        n = np.array([len(x) - 1 for x in ids], dtype=np.int64)
        if self.pack_sides:  # longest first, best fit; every side fits a row (render_pairs cut it to seq_len)
            return ids, mask, plan_packed(n, np.argsort(-n, kind="stable"), self.seq_len)
        return ids, mask, [[(j, 0, int(n[j]))] for j in range(len(ids))]

    def make_batch(self, rows: Sequence[Sequence[Piece]]) -> PairBatch:
        index = [row[0][0] for row in rows]
        ids, mask, layout = self.layout(index)
        built, groups = [], np.zeros((len(layout), self.seq_len), dtype=np.int64)
        for r, pieces in enumerate(layout):
            built.append(build_row(pieces, lambda j, a, b: ids[j][a:b], lambda j, a, b: mask[j][a:b], self.seq_len,
                                   self.pad_id, self.pack_sides))
            at = 0
            for j, _, m in pieces:
                groups[r, at: at + m] = j
                at += m
        batch = collate(built)
        return PairBatch(*(getattr(batch, f) for f in FIELDS), groups=torch.from_numpy(groups),
                         completion_tokens=torch.tensor([int(m[1:].sum()) for m in mask], dtype=torch.int64),
                         pair_index=torch.tensor(index, dtype=torch.int64))

    def padding_fraction(self) -> float:
        """Padding slots / all slots of epoch 0's micro-batches of `micro_batch_size` pairs, laid
        out as this stream lays them out."""
        order = [row[0][0] for row in self.plan(0)]
        B, used, rows = self.micro_batch_size, 0, 0
        for i in range(0, len(order), B):
            _, _, layout = self.layout(order[i: i + B])
            used += sum(m for pieces in layout for (_, _, m) in pieces)
            rows += len(layout)
        return 1.0 - used / max(1, rows * self.seq_len)


def pair_batches(samples: PairSamples, seq_len: int, batch_size: int, pad_id: int,
                 packing: bool = True) -> Iterator[PairBatch]:
    """Every pair once, in order (validation), `batch_size` pairs a batch (the last may be
    short), laid out as `PairStream` does."""
    if not len(samples):
        return iter(())
    return PairStream(samples, seq_len, batch_size, pad_id, seed=0, shuffle=False, packing=packing).batches_once()


__all__ = ["PreferencePair", "PairSamples", "PairBatch", "PairStream", "pair_from_record", "read_pairs",
           "split_pairs", "cap_pairs", "render_pairs", "final_turn_mask", "pair_batches", "FORMS_HELP"]
