"""Tiny checkpoints for the GGUF tests (tests/test_gguf.py, tests/interop/): made inside the
tests, nothing downloaded."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import tiny_config
from lmforge.model import Transformer, resolve_model_config
from lmforge.train.checkpoint import save_checkpoint


def make_checkpoint(tmp: Path, corpus: Path, tok, seed: int = 0, **overrides) -> Path:
    """A step_000000 checkpoint of a tiny random model (dim 64, GQA 4/2 heads, head_dim 16,
    rope_theta and norm_eps off their defaults so a mapping mistake shows; norm weights not 1;
    the output scaled so greedy decoding is far from ties)."""
    sets = {"tokenizer.dir": str(tok.folder), "model.dim": 64, "model.n_heads": 4, "model.n_kv_heads": 2,
            "model.rope_theta": 5000.0, "model.norm_eps": 1e-6, "model.max_seq_len": 256,
            "model.qk_norm": "false"}  # Llama unless a test asks for QK-norm (Qwen3)
    sets.update(overrides)
    cfg = tiny_config(tmp, corpus, **sets)
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    model.reset_parameters(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        model.output.weight.mul_(20)
    return save_checkpoint(tmp / "run", 0, model, cfg, tok.folder)


# -- pretrained-style Hugging Face folders of each tokenizer family (built here, nothing downloaded) --
#: family -> (tokenizer kind, special tokens, tokenizer_config spellings). The special tokens and
#: pre-tokenizers are those of the real families; the vocabularies are trained here on `texts`.
FAMILIES = {
    # GPT-2's ByteLevel regex, as GPT-2 and its descendants save it
    "gpt2": dict(kind="gpt2", specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                 config=dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>")),
    # SmolLM2: digits one at a time, then GPT-2's ByteLevel regex; ChatML; no BOS of its own
    "smollm": dict(kind="smollm", specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                   config=dict(eos_token="<|endoftext|>")),
    # Llama 3: its split regex, ByteLevel without regex, ignore_merges
    "llama3": dict(kind="llama3", specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                             "<|end_header_id|>", "<|eot_id|>"],
                   config=dict(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")),
    # Qwen2: its split regex (Llama 3's with single digits), ByteLevel without regex
    "qwen2": dict(kind="qwen2", specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                  config=dict(eos_token="<|endoftext|>")),
    # Llama 2 / Mistral / TinyLlama: SentencePiece BPE as transformers converts it (byte fallback,
    # Prepend + Replace normalizer, merges listing every split of every piece)
    "spm": dict(kind="spm", specials=["<unk>", "<s>", "</s>"],
                config=dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")),
}


def family_tokenizer(family: str, texts: list[str], vocab_size: int = 800):
    """An HF `tokenizers.Tokenizer` of `family` (see FAMILIES) trained on `texts`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from lmforge.export.gguf_vocab import LLAMA3_PATTERN, QWEN2_PATTERN

    spec = FAMILIES[family]
    kind = spec["kind"]
    if kind == "spm":
        return _spm_tokenizer(texts, vocab_size, spec["specials"])
    tok = Tokenizer(models.BPE(ignore_merges=kind == "llama3"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind in ("gpt2", "smollm"))
    if kind == "gpt2":
        tok.pre_tokenizer = byte_level
    elif kind == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        pattern = LLAMA3_PATTERN if kind == "llama3" else QWEN2_PATTERN
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False), byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=spec["specials"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def _spm_tokenizer(texts: list[str], vocab_size: int, specials: list[str]):
    """Llama 2's tokenizer.json layout: <unk> <s> </s>, the 256 <0xNN> byte tokens, then pieces
    ("▁" for a space, only at a piece's start); merges = every split of every piece into two
    pieces, ordered by the piece's rank, then by the ids of the two halves (what transformers'
    SentencePiece converter writes)."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    space = "\u2581"
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement=space, prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    trained.train_from_iterator(texts, trainer)
    raw = json.loads(trained.to_str())["model"]
    pieces = [t for t, _ in sorted(raw["vocab"].items(), key=lambda kv: kv[1])]
    order = {}  # piece -> rank of the merge that made it (single characters first)
    for r, m in enumerate(raw["merges"]):
        a, b = m.split(" ") if isinstance(m, str) else m
        order.setdefault(a + b, r)
    pieces.sort(key=lambda t: (t in order, order.get(t, 0), t))
    vocab = {t: i for i, t in enumerate([*specials, *(f"<0x{b:02X}>" for b in range(256)), *pieces])}
    merges = []
    for t in sorted(order, key=order.get):
        splits = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab]
        merges += sorted(splits, key=lambda p: (vocab[p[0]], vocab[p[1]]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=specials[0], byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(space), normalizers.Replace(" ", space)])
    tok.decoder = decoders.Sequence([decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


def hf_family_folder(out: Path, family: str, texts: list[str], vocab_size: int = 800, tie: bool = False,
                     seed: int = 0, chat_template: str | None = None) -> Path:
    """A folder as `save_pretrained` writes it for a tiny random Llama of `family`'s tokenizer:
    config.json, model.safetensors, tokenizer.json, tokenizer_config.json. Weights scaled so
    greedy decoding is far from ties."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    hf_tok = family_tokenizer(family, texts, vocab_size)
    spec = FAMILIES[family]
    fast = PreTrainedTokenizerFast(tokenizer_object=hf_tok, clean_up_tokenization_spaces=False, **spec["config"])
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(out)
    n = max(hf_tok.get_vocab(with_added_tokens=True).values()) + 1
    cfg = LlamaConfig(vocab_size=n, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, rope_theta=5000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape))
            else:
                p.normal_(0.0, 0.08)
        model.lm_head.weight.mul_(20 if not tie else 1)
    model.save_pretrained(out, safe_serialization=True)
    return Path(out)
