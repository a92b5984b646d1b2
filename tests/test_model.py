"""The Transformer: shapes at T = 1 and T = seq_len, vocab padding (P6), tied embeddings,
causality, and the KV cache agreeing with a full forward pass (P7)."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.errors import ConfigError, ContractError
from lmforge.model import Transformer, resolve_model_config

VOCAB = 300  # not a multiple of 64: padded to 320
SEQ = 64


def small(**kw) -> ModelConfig:
    base = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=SEQ)
    base.update(kw)
    return ModelConfig(**base)


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(small()).eval()


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("T", [1, 7, SEQ])
def test_logit_shapes(model, B, T):
    tokens = torch.randint(0, VOCAB, (B, T))
    logits = model(tokens)
    assert logits.shape == (B, T, VOCAB)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_vocab_is_padded_but_logits_are_exact(model):
    assert model.vocab_size == VOCAB
    assert model.model_vocab_size == 320
    assert model.tok_embeddings.weight.shape == (320, 32)
    assert model.output.weight.shape == (320, 32)
    # the padding rows of the output take no part: changing them leaves the logits unchanged
    tokens = torch.randint(0, VOCAB, (2, 9))
    before = model(tokens)
    with torch.no_grad():
        saved = model.output.weight[VOCAB:].clone()
        model.output.weight[VOCAB:] = 1e3
    try:
        torch.testing.assert_close(model(tokens), before, rtol=0, atol=0)
    finally:
        with torch.no_grad():
            model.output.weight[VOCAB:] = saved


@pytest.mark.parametrize("vocab, padded", [(64, 64), (65, 128), (384, 384), (8197, 8256)])
def test_padding_rule(vocab, padded):
    m = Transformer(small(vocab_size=vocab, n_layers=1))
    assert m.model_vocab_size == padded
    assert m(torch.tensor([[vocab - 1]])).shape == (1, 1, vocab)


def test_zero_vocab_is_refused():
    with pytest.raises(ConfigError, match="vocab_size is 0"):
        Transformer(small(vocab_size=0))


def test_vocab_from_the_contract(tiny_tokenizer):
    c = tiny_tokenizer.contract
    cfg = resolve_model_config(small(vocab_size=0), c)
    assert cfg.vocab_size == c.vocab_size
    assert resolve_model_config(small(vocab_size=c.model_vocab_size), c).vocab_size == c.vocab_size
    with pytest.raises(ContractError) as exc:
        resolve_model_config(small(vocab_size=c.vocab_size - 1), c)
    assert str(c.vocab_size) in str(exc.value) and str(c.vocab_size - 1) in str(exc.value)
    with pytest.raises(ContractError, match="differs"):
        resolve_model_config(small(vocab_size=c.model_vocab_size + 64), c)


def test_t1_equals_first_position_and_causality(model):
    tokens = torch.randint(0, VOCAB, (2, 16))
    full = model(tokens)
    torch.testing.assert_close(model(tokens[:, :1]), full[:, :1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(tokens[:, :9]), full[:, :9], rtol=1e-5, atol=1e-5)
    changed = tokens.clone()
    changed[:, 12] = (changed[:, 12] + 1) % VOCAB
    out = model(changed)
    torch.testing.assert_close(out[:, :12], full[:, :12], rtol=0, atol=0)
    assert not torch.allclose(out[:, 12:], full[:, 12:])


def test_batch_rows_are_independent(model):
    tokens = torch.randint(0, VOCAB, (3, 12))
    full = model(tokens)
    for i in range(3):
        torch.testing.assert_close(model(tokens[i: i + 1]), full[i: i + 1], rtol=1e-5, atol=1e-5)


def test_kv_cache_decode_matches_full_forward(model):
    tokens = torch.randint(0, VOCAB, (2, 20))
    full = model(tokens)
    cache = model.new_cache(2, 20)
    steps = [model(tokens[:, :8], cache=cache)]  # prefill
    for t in range(8, 20):  # T = 1 decode steps
        steps.append(model(tokens[:, t: t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)
    assert cache.length == 20


def test_document_ids_and_positions_isolate_documents(model):
    """Two documents packed in one row give the same logits as each run alone."""
    a = torch.randint(0, VOCAB, (1, 10))
    b = torch.randint(0, VOCAB, (1, 6))
    packed = torch.cat([a, b], dim=1)
    doc_ids = torch.tensor([[0] * 10 + [1] * 6])
    positions = torch.tensor([list(range(10)) + list(range(6))])
    out = model(packed, positions, doc_ids)
    torch.testing.assert_close(out[:, :10], model(a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, 10:], model(b), rtol=1e-5, atol=1e-5)


def test_tied_embeddings():
    torch.manual_seed(0)
    untied = Transformer(small())
    tied = Transformer(small(tie_embeddings=True))
    assert tied.output.weight is tied.tok_embeddings.weight
    assert untied.output.weight is not untied.tok_embeddings.weight
    assert untied.num_parameters() - tied.num_parameters() == 320 * 32
    assert tied.num_parameters(non_embedding=True) == untied.num_parameters(non_embedding=True)
    # logits are h @ E[:vocab].T: check against the embedding matrix directly
    tokens = torch.randint(0, VOCAB, (2, 5))
    h = tied.hidden(tokens)
    torch.testing.assert_close(tied(tokens), h @ tied.tok_embeddings.weight[:VOCAB].T, rtol=1e-5, atol=1e-5)
    # a gradient step moves the shared matrix through both uses
    tied(tokens).sum().backward()
    assert tied.tok_embeddings.weight.grad is not None
    assert tied.output.weight.grad is tied.tok_embeddings.weight.grad


def test_reset_parameters_is_seeded():
    a, b = Transformer(small()), Transformer(small())
    a.reset_parameters(seed=3)
    b.reset_parameters(seed=3)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    assert torch.all(a.layers[0].attention_norm.weight == 1)
    b.reset_parameters(seed=4)
    assert not torch.equal(a.tok_embeddings.weight, b.tok_embeddings.weight)


def test_unknown_attention_backend(model):
    with pytest.raises(ConfigError, match="attention backend 'flash'"):
        model.set_attention("flash")
