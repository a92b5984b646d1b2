"""The runtime `Tokenizer`: a tokenizer folder loaded and checked against its contract;
text to ids and back, documents and prompts, and chats rendered with the contract's template."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from lmforge.contract import CONTRACT_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Contract, check_tokenizer_hash
from lmforge.errors import ContractError, DataError
from lmforge.fileio import load_hf_tokenizer
from lmforge.tokenizer.chat import ChatRendering, ChatTemplate
from lmforge.tokenizer.hf_json import read_json, template_vars, token_text, check_prefix_space
from lmforge.tokenizer.specials import CHAT_TEMPLATE, SPECIAL_TOKENS, special_ids_of, spellings_of, vocab_size_of


class Tokenizer:
    """A tokenizer folder (trained or imported): tokenizer.json + tokenizer_config.json + contract.json."""

    def __init__(self, hf: HFTokenizer, contract: Contract, folder: Path):
        self.hf = hf
        self.contract = contract
        self.folder = folder
        self.spellings: dict[str, str | None] = dict(SPECIAL_TOKENS)
        """Special-token strings by name (an imported tokenizer keeps its own, e.g. "</s>"; None
        where the contract has no such token)."""
        self._chat: "ChatTemplate | None" = None
        self.hf.encode_special_tokens = True  # data path: special spellings are plain text

    @classmethod
    def load(cls, folder: str | Path) -> "Tokenizer":
        """Load a tokenizer folder and check it against its contract.

        Raises:
            ContractError: missing files (a foreign folder without contract.json: run
            `lmforge import-tokenizer`), a hash that does not match, special ids or a vocab size
            that differ from the contract, add_prefix_space disagreeing between the two files.
        """
        folder = Path(folder)
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            raise ContractError(
                f"tokenizer folder {folder} has no {TOKENIZER_FILE}. Train one with "
                f"`lmforge train-tokenizer --out {folder}` or set tokenizer.dir."
            )
        if not (folder / CONTRACT_FILE).is_file():
            raise ContractError(
                f"tokenizer folder {folder} has a {TOKENIZER_FILE} but no {CONTRACT_FILE}: it was not made "
                f"by lmforge. Import it first: `lmforge import-tokenizer --from {folder} --out DIR`, then "
                f"set tokenizer.dir=DIR."
            )
        contract = Contract.load(folder, what="tokenizer folder")
        check_tokenizer_hash(contract, folder / CONTRACT_FILE, path)
        try:
            hf = load_hf_tokenizer(path)
        except Exception as exc:  # the tokenizers library raises a bare Exception on a file it cannot parse
            raise ContractError(
                f"{path} is not a tokenizer the `tokenizers` library can read ({str(exc).splitlines()[0][:200]}). "
                f"Re-create the folder with `lmforge train-tokenizer` or `lmforge import-tokenizer`."
            ) from None
        vocab = vocab_size_of(hf)
        if vocab != contract.vocab_size:
            raise ContractError(
                f"{folder / CONTRACT_FILE}: vocab_size = {contract.vocab_size}, but {path} has {vocab} ids. "
                f"Re-create the folder with `lmforge train-tokenizer` or `lmforge import-tokenizer`."
            )
        spellings = spellings_of(hf, contract)
        ids = special_ids_of(hf, str(path), spellings)  # each a special added token: plain text never makes it
        if ids != contract.special_tokens:
            raise ContractError(
                f"{folder / CONTRACT_FILE}: special_tokens {contract.special_tokens} differ from "
                f"the ids in {path}: {ids} (spellings {spellings}). "
                f"Re-create the folder with `lmforge train-tokenizer` or `lmforge import-tokenizer`."
            )
        config = read_json(folder / TOKENIZER_CONFIG_FILE) if (folder / TOKENIZER_CONFIG_FILE).is_file() else {}
        check_prefix_space(read_json(path), config, path, folder / TOKENIZER_CONFIG_FILE)
        # tokenizer_config.json names the same tokens (an imported model's eos_token may be its turn end)
        agree = {"eos_token": {spellings["eos"], spellings["im_end"]}, "pad_token": {spellings["pad"]}}
        if contract.add_bos:
            agree["bos_token"] = {spellings["bos"]}
        for key, allowed in agree.items():
            text = token_text(config.get(key))
            if text is not None and text not in allowed:
                raise ContractError(
                    f"{folder / TOKENIZER_CONFIG_FILE}: {key} = {text!r}, but the special_tokens of "
                    f"{folder / CONTRACT_FILE} name {sorted(allowed)}. One of the files was edited; re-create the "
                    f"folder with `lmforge train-tokenizer` or `lmforge import-tokenizer`.")
        tok = cls(hf, contract, folder)
        tok.spellings = spellings
        return tok

    def chat_encoder(self) -> HFTokenizer:
        """A copy of the tokenizer that recognises special-token spellings (a rendered chat
        template's text, as transformers tokenizes it); the data path never uses it."""
        if "_chat_hf" not in self.__dict__:
            hf = HFTokenizer.from_str(self.hf.to_str())
            hf.encode_special_tokens = False
            self.__dict__["_chat_hf"] = hf
        return self.__dict__["_chat_hf"]

    # -- special ids, from the contract only (P1) --------------------------------
    @property
    def vocab_size(self) -> int:
        return self.contract.vocab_size

    @property
    def pad_id(self) -> int:
        return self.contract.pad_id

    @property
    def bos_id(self) -> int:
        return self.contract.bos_id

    @property
    def eos_id(self) -> int:
        return self.contract.eos_id

    @property
    def im_start_id(self) -> int:
        return self.contract.im_start_id

    @property
    def im_end_id(self) -> int:
        return self.contract.im_end_id

    # -- text <-> ids -------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Plain text to ids; special-token spellings stay plain text. No BOS/EOS added."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode_document(self, text: str) -> list[int]:
        """A pretraining document: the contract's document start ([bos], or nothing for a model
        without one) + encode(text) + [eos] (EOS terminates, P2)."""
        return [*self.contract.document_start, *self.encode(text), self.eos_id]

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt: a document start (the contract's `document_start`) + encode(text)."""
        return [*self.contract.document_start, *self.encode(text)]

    def fit_prompt(self, ids: Sequence[int], budget: int) -> list[int]:
        """A prompt (`encode_prompt`, or a chat rendered with the generation prompt) cut to its
        last `budget` tokens, keeping its document start: a prompt that starts with the
        contract's BOS keeps it in front (a Gemma model without its BOS is catastrophically
        worse: lambada perplexity 5.9e9 instead of 3.46). Shorter
        prompts, and a budget with no room beside the BOS, are left as they are (generate's own
        check then cuts or refuses them)."""
        ids = list(ids)
        start = self.contract.document_start
        if len(ids) <= budget or not start or ids[: len(start)] != start or budget <= len(start):
            return ids
        return [*start, *ids[len(ids) - (budget - len(start)):]]

    @property
    def chat_template(self) -> "ChatTemplate":
        """The contract's chat template, compiled (lmforge's ChatML, or an imported model's own)."""
        if self._chat is None:
            self._chat = ChatTemplate(self.contract.chat_template, self.template_variables(),
                                      f"the chat template of {self.folder / TOKENIZER_CONFIG_FILE}")
        return self._chat

    def template_variables(self) -> dict[str, str]:
        """What `transformers` passes a chat template besides the messages: tokenizer_config.json's
        special-token strings (bos_token, eos_token, unk_token, pad_token), where set."""
        path = self.folder / TOKENIZER_CONFIG_FILE
        return template_vars(read_json(path) if path.is_file() else {})

    def _check_one_bos(self, ids: Sequence[int]) -> None:
        """A chat rendering never starts with two BOS tokens (the double-BOS pitfall: a template
        that writes `{{ bos_token }}` and a tokenizer that prepends one more). lmforge tokenizes a
        rendered template as transformers does, without adding special tokens, so the BOS is
        the template's own: exactly one when it writes `{{ bos_token }}` once (Gemma, Llama 3,
        Mistral), none when it writes none (the rows every stage builds, SFT, DPO, RL prompts
        and chat prompts, are these renderings).

        Raises:
            DataError: the rendering starts with the BOS twice, naming the template.
        """
        bos = self.contract.bos_id
        if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            raise DataError(
                f"{self.chat_template.name} renders a conversation starting with two BOS tokens "
                f"({self.spellings['bos']!r} twice); expected one: the template writes the BOS, and lmforge adds none "
                f"to a rendered chat (as transformers' apply_chat_template). A model trained or prompted with a double "
                f"BOS sees text it was never trained on. Fix the template to write {{{{ bos_token }}}} once.")

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> ChatRendering:
        """The conversation's ids and the assistant-only loss mask, rendered with the contract's
        chat template: equal, id for id, to `transformers`' apply_chat_template on this folder.

        lmforge's ChatML (CHAT_TEMPLATE) is built directly, with message contents as plain text
        (text that spells a special token stays text). Any other template (an imported model's
        own) goes through `ChatTemplate.render_ids`, which renders it with Jinja as transformers
        does and finds the assistant spans by rendering prefixes.

        Each message: {"role": "system"|"user"|"assistant", "content": str}.
        Raises:
            DataError: a template lmforge cannot render faithfully for this conversation, or a
            template's own error (e.g. roles that do not alternate), naming the template.
        """
        if self.contract.chat_template != CHAT_TEMPLATE:
            rendering = self.chat_template.render_ids(self, messages, add_generation_prompt)
            self._check_one_bos(rendering.ids)
            return rendering
        ids: list[int] = []
        mask: list[int] = []
        # Text between two special tokens is encoded as one piece, as transformers does
        # after rendering the template to a string; a token is learned when it starts
        # inside the assistant's content.
        for i, m in enumerate(messages):
            lead = "\n" if i > 0 else ""  # the newline after the previous <|im_end|>
            if lead:
                piece = self.encode(lead)
                ids += piece
                mask += [0] * len(piece)
            head = m["role"] + "\n"
            enc = self.hf.encode(head + m["content"], add_special_tokens=False)
            learn = m["role"] == "assistant"
            ids.append(self.im_start_id)
            mask.append(0)
            for tid, (start, _end) in zip(enc.ids, enc.offsets):
                ids.append(tid)
                mask.append(1 if learn and start >= len(head) else 0)
            ids.append(self.im_end_id)
            mask.append(1 if learn else 0)
        if messages:
            piece = self.encode("\n")
            ids += piece
            mask += [0] * len(piece)
        if add_generation_prompt:
            head = [self.im_start_id, *self.encode("assistant\n")]
            ids += head
            mask += [0] * len(head)
        return ChatRendering(ids, mask)
