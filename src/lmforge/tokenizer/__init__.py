"""Tokenizers: lmforge's byte-level BPE (training, loading), a model's own brought in
(`foreign.import_tokenizer`), and chat templates rendered as transformers renders them.

The tokenizer is one Hugging Face `tokenizer.json` (pre-tokenizer, decoder and
post-processor in one object) plus `tokenizer_config.json`, so `transformers`'
`AutoTokenizer` loads the same folder (P4). The pre-tokenizer is Qwen2's split
regex (Llama 3's, digits one at a time) followed by `ByteLevel(use_regex=False)`,
with tokens capped at 32 bytes: llama.cpp's `qwen2` pre-tokenizer reproduces it.

Special tokens are declared here, by name, and nowhere else; their ids are read
from the trained tokenizer and recorded in the contract (P1). On the data path,
text that spells a special token is plain text (`encode_special_tokens = True`);
only `render_chat` emits real special tokens.

Bring your own tokenizer: `import_tokenizer` (the `lmforge import-tokenizer` command)
turns a Hugging Face tokenizer folder into an lmforge one that follows the model's own
conventions: its document terminator (the vocabulary's <|endoftext|> / <|end_of_text|> / </s>
where eos_token ends a chat turn), its BOS or none (`add_bos`), its chat template and the
token that ends a turn; it adds a distinct <|pad|> when the foreign PAD is another special
token (labels are masked by the batch's loss mask, never by comparing ids with pad_id), and
ChatML's tokens only for a folder without a chat template. A foreign template is rendered by
`ChatTemplate` as `transformers` renders it.

One module per job, lowest first (each imports only those above it):

    specials    SPECIAL_TOKENS, CHAT_TEMPLATE (ChatML), the ids a tokenizer gives them
    hf_json     reading tokenizer_config.json / tokenizer.json; add_prefix_space checked
    chat        ChatTemplate (a Jinja template as transformers renders it), ChatRendering
    runtime     Tokenizer: a folder loaded and checked against its contract
    train       train_tokenizer, save_tokenizer (the folder, written atomically)
    foreign     import_tokenizer (bring your own tokenizer)
This package is the one import surface: import from `lmforge.tokenizer`.
"""

from lmforge.contract import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from lmforge.tokenizer.specials import CHAT_TEMPLATE, SPECIAL_TOKENS, special_ids_of, spellings_of, vocab_size_of
from lmforge.tokenizer.hf_json import check_prefix_space
from lmforge.tokenizer.chat import PROBE_CHAT, ChatRendering, ChatTemplate
from lmforge.tokenizer.runtime import Tokenizer
from lmforge.tokenizer.train import (
    MAX_TOKEN_BYTES,
    MAX_TRAINING_WORD,
    SPLIT_PATTERN,
    TOKENIZER_OUTPUT,
    bounded_words,
    byte_decoder,
    save_tokenizer,
    train_tokenizer,
)
from lmforge.tokenizer.foreign import (
    ROUND_TRIP_PROBES,
    TERMINATOR_SPELLINGS,
    TURN_END_SPELLINGS,
    FamilyTemplate,
    import_tokenizer,
    short_repr,
)

__all__ = [
    "CHAT_TEMPLATE", "ChatRendering", "ChatTemplate", "FamilyTemplate", "MAX_TOKEN_BYTES", "MAX_TRAINING_WORD",
    "PROBE_CHAT", "ROUND_TRIP_PROBES", "SPECIAL_TOKENS", "SPLIT_PATTERN", "TERMINATOR_SPELLINGS",
    "TOKENIZER_CONFIG_FILE", "TOKENIZER_FILE", "TOKENIZER_OUTPUT", "TURN_END_SPELLINGS", "Tokenizer", "bounded_words", "byte_decoder",
    "check_prefix_space", "import_tokenizer", "save_tokenizer", "short_repr", "special_ids_of", "spellings_of",
    "train_tokenizer", "vocab_size_of",
]
