"""Special tokens by name, lmforge's ChatML template, and the ids a tokenizer gives those tokens:
what every tokenizer folder (trained or imported) is checked against."""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer

from lmforge.contract import OPTIONAL_SPECIALS, Contract
from lmforge.errors import ContractError

#: Special tokens by name (the one place they are spelled). Order = id order when
#: lmforge trains a tokenizer; nothing depends on that order (a test permutes it).
SPECIAL_TOKENS: dict[str, str] = {
    "pad": "<|pad|>",
    "bos": "<|bos|>",
    "eos": "<|eos|>",
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
}

#: ChatML, as a Jinja template that `transformers.apply_chat_template` runs; `render_chat`
#: (runtime.py) builds the same ids directly (a test proves they agree).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def vocab_size_of(tok: HFTokenizer) -> int:
    """Number of ids, special tokens included: the largest id + 1 (a gap, if any, is never produced)."""
    return max(max(tok.get_vocab(with_added_tokens=True).values()) + 1, tok.get_vocab_size(with_added_tokens=True))


def special_ids_of(tok: HFTokenizer, where: str, spellings: dict[str, str] | None = None) -> dict[str, int]:
    """Ids of the special tokens by name, looked up by their spellings (default SPECIAL_TOKENS).

    Raises:
        ContractError: a spelling is not in the tokenizer, or is not a special added token
        (then plain text could produce its id).
    """
    spellings = spellings or SPECIAL_TOKENS
    special = {a.content for a in tok.get_added_tokens_decoder().values() if a.special}
    ids = {}
    for name in SPECIAL_TOKENS:
        text = spellings.get(name)
        if text is None and name in OPTIONAL_SPECIALS:  # a model without a BOS / a ChatML turn start
            ids[name] = None
            continue
        i = tok.token_to_id(text)
        if i is None:
            raise ContractError(f"{where}: the tokenizer has no {text!r} token ({name}).")
        if text not in special:
            raise ContractError(
                f"{where}: {text!r} ({name}) is not registered as a special token, so plain text that "
                f"spells it would encode to its id. Import the tokenizer with `lmforge import-tokenizer`."
            )
        ids[name] = i
    return ids


def spellings_of(hf: HFTokenizer, contract: Contract) -> dict[str, str | None]:
    """Special-token strings by name: the tokens at the contract's ids (None where the contract
    has none). The contract is the only place special ids live (P1); tokenizer_config.json's
    bos_token / eos_token are what `transformers` and the chat template see, which for an
    imported model are its own (e.g. eos_token "<|im_end|>" while documents end with
    "<|endoftext|>")."""
    return {name: (None if i is None else hf.id_to_token(i)) for name, i in contract.special_tokens.items()}
