"""Generation: stops at EOS, respects max_new_tokens, refuses prompts that do not fit,
and its KV-cache greedy decode equals argmax over full forward passes."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.generate import SamplingConfig, generate, sample_next
from lmforge.model import Transformer

VOCAB = 300
MAX_LEN = 64
EOS, PAD = 7, 3  # a model of its own: its ids come from this test, not from a tokenizer


def model_that_always_says(token: int) -> Transformer:
    """A model whose every next-token argmax is `token`, whatever the prompt.

    The blocks' output projections (wo, w2) are zeroed, so the residual stream is the token
    embedding; every embedding row is the same vector of ones, so the final RMSNorm gives
    h = ones; the output row of `token` is ones and every other row zero, so the logits are
    `dim` for `token` and 0 elsewhere."""
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=MAX_LEN)
    m = Transformer(cfg)
    with torch.no_grad():
        for block in m.layers:
            block.attention.wo.weight.zero_()
            block.feed_forward.w2.weight.zero_()
        m.tok_embeddings.weight.fill_(1.0)
        m.output.weight.zero_()
        m.output.weight[token] = 1.0
    return m.eval()


def random_model(seed: int = 0) -> Transformer:
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=MAX_LEN)
    m = Transformer(cfg)
    m.reset_parameters(seed=seed)
    with torch.no_grad():  # spread the logits so greedy choices are far from ties
        m.output.weight.mul_(20)
    return m.eval()


def test_the_constructed_model_prefers_eos():
    m = model_that_always_says(EOS)
    logits = m(torch.randint(0, VOCAB, (2, 5)))
    assert (logits.argmax(-1) == EOS).all()
    assert torch.allclose(logits[..., EOS], torch.full((2, 5), 32.0), atol=1e-3)


@pytest.mark.parametrize("greedy", [True, False])
def test_stops_at_eos(greedy):
    m = model_that_always_says(EOS)
    cfg = SamplingConfig(max_new_tokens=20, greedy=greedy, temperature=1.0, top_k=0, top_p=1.0)
    gen = torch.Generator().manual_seed(0)
    out = generate(m, [[1, 10, 11, 12]], [EOS], cfg, PAD, generator=gen)
    assert out == [[EOS]]


def test_batch_stops_each_row_at_its_own_eos():
    """The next token depends on the last token only: after 20 comes 42, after anything else
    EOS. Row 0 ends in 20 so it says [42, EOS]; row 1 says [EOS] at once and then waits."""
    m = model_that_always_says(EOS)
    v2 = torch.tensor([1.0, -1.0] * 16)  # orthogonal to the all-ones embedding
    with torch.no_grad():
        m.tok_embeddings.weight[20] = v2
        m.output.weight[42] = v2
    out = generate(m, [[1, 10, 20], [1, 12]], [EOS], SamplingConfig(max_new_tokens=6, greedy=True), PAD)
    assert out == [[42, EOS], [EOS]]
    m2 = model_that_always_says(42)
    out = generate(m2, [[1, 10, 11], [1, 12]], [EOS, 43], SamplingConfig(max_new_tokens=5, greedy=True), PAD)
    assert out == [[42] * 5, [42] * 5]


def test_any_stop_id_stops():
    m = model_that_always_says(42)
    out = generate(m, [[1, 2, 3]], [EOS, 42], SamplingConfig(max_new_tokens=9, greedy=True), PAD)
    assert out == [[42]]


@pytest.mark.parametrize("n", [1, 5, 17])
def test_max_new_tokens_is_respected(n):
    m = random_model()
    out = generate(m, [[1, 5, 9], [1]], [], SamplingConfig(max_new_tokens=n, temperature=1.0), PAD,
                   generator=torch.Generator().manual_seed(0))
    assert [len(o) for o in out] == [n, n]
    assert all(0 <= i < VOCAB for o in out for i in o)


def test_greedy_kv_cache_matches_full_recompute():
    m = random_model(seed=1)
    prompts = [[1, 17, 250, 33, 4, 90], [1, 8]]  # different lengths: the second is left-padded
    n = 12
    out = generate(m, prompts, [], SamplingConfig(max_new_tokens=n, greedy=True), PAD)
    for p, o in zip(prompts, out):
        seq = list(p)
        for _ in range(n):
            seq.append(int(m(torch.tensor([seq]))[0, -1].argmax()))
        assert o == seq[len(p):]


def test_sampling_is_seeded():
    m = random_model(seed=2)
    cfg = SamplingConfig(max_new_tokens=10, temperature=1.0, top_k=20, top_p=0.9)
    a = generate(m, [[1, 2]], [], cfg, PAD, generator=torch.Generator().manual_seed(5))
    b = generate(m, [[1, 2]], [], cfg, PAD, generator=torch.Generator().manual_seed(5))
    assert a == b


def test_prompt_too_long():
    m = random_model()
    cfg = SamplingConfig(max_new_tokens=8, greedy=True)
    prompt = [1] + list(range(10, 70))  # 61 tokens; 61 + 8 > 64
    with pytest.raises(LmforgeError) as exc:
        generate(m, [prompt], [EOS], cfg, PAD)
    msg = str(exc.value)
    assert "61 tokens" in msg and "max_seq_len = 64" in msg and "--truncate" in msg
    out = generate(m, [prompt], [], cfg, PAD, truncate=True)
    assert len(out[0]) == 8
    # truncation keeps the prompt's last tokens: the same as generating from them directly
    assert out == generate(m, [prompt[-(MAX_LEN - 8):]], [], cfg, PAD)


def test_prompt_that_just_fits():
    m = random_model()
    cfg = SamplingConfig(max_new_tokens=8, greedy=True)
    out = generate(m, [list(range(1, 57))], [], cfg, PAD)  # 56 + 8 == 64
    assert len(out[0]) == 8


def test_empty_prompt_and_no_room():
    m = random_model()
    with pytest.raises(LmforgeError, match="prompt 1 is empty"):
        generate(m, [[1], []], [EOS], SamplingConfig(max_new_tokens=4), PAD)
    with pytest.raises(LmforgeError, match="max_new_tokens = 64 leaves no room"):
        generate(m, [[1]], [EOS], SamplingConfig(max_new_tokens=64), PAD)


def test_sample_next_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    assert sample_next(logits, SamplingConfig(greedy=True)).tolist() == [4]
    assert sample_next(logits, SamplingConfig(temperature=0.0)).tolist() == [4]
    gen = torch.Generator().manual_seed(0)
    # top_k = 2 only ever picks the two largest
    picks = {int(sample_next(logits, SamplingConfig(temperature=1.0, top_k=2, top_p=1.0), generator=gen))
             for _ in range(200)}
    assert picks == {3, 4}
    # top_p: softmax([0..4]) = [.012, .032, .086, .234, .636]; top_p = 0.8 keeps {4, 3}
    picks = {int(sample_next(logits, SamplingConfig(temperature=1.0, top_k=0, top_p=0.8), generator=gen))
             for _ in range(200)}
    assert picks == {3, 4}
    # a repetition penalty on the favourite hands greedy decoding to the runner-up
    hist = torch.tensor([[4, -1]])
    assert sample_next(logits, SamplingConfig(greedy=True, repetition_penalty=2.0), hist).tolist() == [3]


def test_generate_text_on_a_trained_tokenizer(tiny_tokenizer):
    """generate_text prepends <|bos|>, drops the final <|eos|> and returns prompt + completion."""
    from lmforge.config import ModelConfig as MC
    from lmforge.stages import generate_text

    tok = tiny_tokenizer
    m = Transformer(MC(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=tok.vocab_size, max_seq_len=64))
    with torch.no_grad():
        m.layers[0].attention.wo.weight.zero_()
        m.layers[0].feed_forward.w2.weight.zero_()
        m.tok_embeddings.weight.fill_(1.0)
        m.output.weight.zero_()
        m.output.weight[tok.eos_id] = 1.0
    assert generate_text(m, tok, "def value", SamplingConfig(max_new_tokens=5, greedy=True)) == "def value"


def test_prompt_id_outside_the_vocab():
    m = random_model()
    with pytest.raises(LmforgeError) as exc:
        generate(m, [[1, VOCAB + 5]], [EOS], SamplingConfig(max_new_tokens=4), PAD)
    assert f"token id {VOCAB + 5}" in str(exc.value) and f"[0, {VOCAB})" in str(exc.value)


@pytest.mark.parametrize("field, value", [("max_new_tokens", 0), ("temperature", -1.0), ("top_p", 0.0),
                                          ("top_k", -1)])
def test_bad_sampling_settings(field, value):
    from dataclasses import replace

    with pytest.raises(LmforgeError, match=field):
        generate(random_model(), [[1, 2]], [EOS], replace(SamplingConfig(), **{field: value}), PAD)
