"""The KV cache and batched generation: cached logits equal a full recomputation at every
decode step (fp32, 1e-5), left-padded batches equal one prompt at a time, T = 1 steps
work from a one-token prompt, and sampling filters match `transformers`' processors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.generate import (
    SamplingConfig,
    apply_repetition_penalty,
    filter_logits,
    generate,
    left_pad,
    output_projection,
    seen_mask,
)
from lmforge.model import Transformer

VOCAB, PAD, MAX_LEN = 200, 0, 96


def model(seed: int = 0, **kw) -> Transformer:
    cfg = ModelConfig(**{**dict(dim=48, n_layers=3, n_heads=6, n_kv_heads=2, vocab_size=VOCAB,
                                max_seq_len=MAX_LEN), **kw})
    m = Transformer(cfg)
    m.reset_parameters(seed=seed)
    with torch.no_grad():
        m.output.weight.mul_(20)  # spread logits: greedy choices far from ties
    return m.eval()


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("lengths", [[7], [1], [9, 3, 1, 6]])
def test_cached_logits_equal_full_recompute_at_every_step(lengths):
    """Prefill (left-padded, key mask) then T = 1 steps; each step's logits per row equal the
    last-position logits of a full forward over that row's unpadded sequence so far."""
    m = model(seed=1)
    rows = prompts(lengths, seed=2)
    steps = 12
    tokens, positions, key_mask = left_pad(rows, PAD, steps)
    B, L = tokens.shape
    padded = not bool(key_mask.all())
    cache = m.new_cache(B, L + steps, key_mask if padded else None)
    seqs = [list(r) for r in rows]
    with torch.inference_mode():
        logits = m(tokens, positions, cache=cache)[:, -1]
        pos = positions[:, -1:] + 1
        for step in range(steps):
            for i, seq in enumerate(seqs):
                full = m(torch.tensor([seq]))[0, -1]
                err = float((logits[i] - full).abs().max())
                assert err < 1e-5, f"row {i}, step {step}: cached logits differ by {err}"
            nxt = logits.argmax(-1)
            for i, seq in enumerate(seqs):
                seq.append(int(nxt[i]))
            assert cache.length == L + step
            logits = m(nxt[:, None], pos, cache=cache)[:, -1]  # T = 1
            pos = pos + 1
    assert len(set(map(tuple, seqs))) == len(seqs) or len(seqs) == 1  # rows really differ


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_batched_left_padded_generation_equals_one_by_one(penalty):
    m = model(seed=3)
    rows = prompts([1, 12, 5, 30, 2, 5], seed=4)  # equal lengths too (5 and 5)
    cfg = SamplingConfig(max_new_tokens=20, greedy=True, repetition_penalty=penalty)
    batched = generate(m, rows, [], cfg, PAD)
    alone = [generate(m, [r], [], cfg, PAD)[0] for r in rows]
    assert batched == alone
    assert all(len(o) == 20 for o in batched)
    assert len({tuple(o) for o in batched}) > 1


def test_batched_generation_with_stops_equals_one_by_one():
    """Rows stop at different steps; a stopped row's later steps (fed padding) change nothing."""
    m = model(seed=5)
    rows = prompts([3, 8, 1, 14], seed=6)
    free = generate(m, rows, [], SamplingConfig(max_new_tokens=16, greedy=True), PAD)
    stop = free[1][4]  # a token row 1 produces at step 5: at least that row stops early
    cfg = SamplingConfig(max_new_tokens=16, greedy=True)
    batched = generate(m, rows, [stop], cfg, PAD)
    assert batched == [generate(m, [r], [stop], cfg, PAD)[0] for r in rows]
    for out, ref in zip(batched, free):
        cut = ref.index(stop) + 1 if stop in ref else len(ref)
        assert out == ref[:cut]
    assert len(batched[1]) <= 5


def test_generation_is_independent_of_batch_companions():
    """Sampling aside, a prompt's greedy continuation does not depend on what it is batched with
    (padding really is masked: P5)."""
    m = model(seed=7)
    target = prompts([6], seed=8)[0]
    ref = generate(m, [target], [], SamplingConfig(max_new_tokens=10, greedy=True), PAD)[0]
    for companions in ([[5] * 40], prompts([2, 25], seed=9), [[PAD] * 30]):
        out = generate(m, [*companions, target], [], SamplingConfig(max_new_tokens=10, greedy=True), PAD)
        assert out[-1] == ref


def test_one_token_prompts_decode_in_t1_steps():
    m = model(seed=10)
    out = generate(m, [[5], [9]], [], SamplingConfig(max_new_tokens=8, greedy=True), PAD)
    for p, o in zip([[5], [9]], out):
        seq = list(p)
        for _ in range(8):
            seq.append(int(m(torch.tensor([seq]))[0, -1].argmax()))
        assert o == seq[1:]


def test_prompts_that_do_not_fit_error_or_truncate():
    m = model(seed=11)
    long = prompts([MAX_LEN + 10], seed=12)[0]  # longer than max_seq_len itself
    cfg = SamplingConfig(max_new_tokens=6, greedy=True)
    with pytest.raises(LmforgeError) as exc:
        generate(m, [[1, 2], long], [], cfg, PAD)
    msg = str(exc.value)
    assert f"prompt 1 has {MAX_LEN + 10} tokens" in msg and f"max_seq_len = {MAX_LEN}" in msg
    assert "truncate" in msg
    out = generate(m, [[1, 2], long], [], cfg, PAD, truncate=True)
    assert out[1] == generate(m, [long[-(MAX_LEN - 6):]], [], cfg, PAD)[0]
    assert out[0] == generate(m, [[1, 2]], [], cfg, PAD)[0]


def test_bf16_autocast_generation_runs_with_a_bf16_cache():
    m = model(seed=13)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cache = m.new_cache(1, 8)
        out = generate(m, [[1, 2, 3]], [], SamplingConfig(max_new_tokens=5, greedy=True), PAD)
    assert cache.k[0].dtype == torch.bfloat16 and len(out[0]) == 5


def test_output_projection_equals_model_logits(monkeypatch):
    import lmforge.generate as G

    m = model(seed=16)
    h = torch.randn(5, 48)
    with torch.inference_mode():
        ref = m.logits(h)
        torch.testing.assert_close(output_projection(m)(h), ref, rtol=1e-5, atol=1e-5)
        monkeypatch.setattr(G, "HEAD_COPY_LIMIT", 0)  # too big to copy: model.logits itself
        assert torch.equal(output_projection(m)(h), ref)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert output_projection(m)(h).dtype == m.logits(h).dtype == torch.bfloat16


def test_seen_mask_and_penalty():
    hist = torch.tensor([[3, -1, 3, 0], [-1, -1, -1, -1]])
    seen = seen_mask(hist, 5)
    assert seen.tolist() == [[True, False, False, True, False], [False] * 5]
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5], [2.0, -2.0, 1.0, -1.0, 0.5]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.0, -2.0, 1.0, -2.0, 0.5], logits[1].tolist()]


def test_repetition_penalty_equals_transformers():
    pytest.importorskip("transformers")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    ids = torch.randint(0, 50, (3, 12), generator=g)
    ref = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone())
    ours = apply_repetition_penalty(logits, seen_mask(ids, 50), 1.7)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 5, 1.0), (0.7, 0, 0.9), (1.3, 20, 0.5),
                                                       (1.0, 0, 0.999)])
def test_temperature_top_k_top_p_equal_transformers(temperature, top_k, top_p):
    pytest.importorskip("transformers")
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 64, generator=g) * 2
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    ours = filter_logits(logits, SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p))
    ref = ref - ref.amax(-1, keepdim=True)  # ours is shifted so each row's best logit is 0 (same softmax)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))
    torch.testing.assert_close(ours[torch.isfinite(ours)], ref[torch.isfinite(ref)])
    assert 1 <= int(torch.isfinite(ours).sum(-1).min()) < 64 or top_p == 0.999


def test_sampled_generation_is_seeded_and_respects_filters():
    m = model(seed=14)
    cfg = replace(SamplingConfig(max_new_tokens=12), temperature=1.0, top_k=3, top_p=1.0)
    rows = prompts([4, 9], seed=15)
    a = generate(m, rows, [], cfg, PAD, generator=torch.Generator().manual_seed(1))
    b = generate(m, rows, [], cfg, PAD, generator=torch.Generator().manual_seed(1))
    assert a == b
    for r, out in zip(rows, a):  # every sampled token is among the top 3 of its step
        seq = list(r)
        for t in out:
            top3 = m(torch.tensor([seq]))[0, -1].topk(3).indices.tolist()
            assert t in top3
            seq.append(t)


def test_the_masked_whole_cache_step_equals_the_growing_one_with_left_padding():
    """`decode_step` with a slot tensor (what the compiled step runs: every step attends over the
    whole cache with a mask) equals the step over the filled slots, left padding included."""
    from lmforge.model.decode import decode_step

    m = model(seed=7)
    rows = prompts([9, 3, 1, 6], seed=8)
    tokens, positions, key_mask = left_pad(rows, PAD, 6)
    B, L = tokens.shape
    caches = [m.new_cache(B, L + 6, key_mask) for _ in range(2)]
    with torch.inference_mode():
        for c in caches:
            m(tokens, positions, cache=c)
        nxt, pos = torch.tensor([5, 17, 33, 90]), positions[:, -1] + 1
        for _ in range(5):
            a = decode_step(m, nxt, pos, caches[0])
            slots = torch.full((B,), caches[1].length)
            b = decode_step(m, nxt, pos, caches[1], slots)
            caches[1].length += 1
            assert float((a - b).abs().max()) < 1e-5
            nxt, pos = a.argmax(-1), pos + 1


@pytest.mark.slow
def test_compiled_decode_generates_the_same_ids():
    """generate.compile: the compiled decode step (one graph for every batch size and cache
    length) gives the eager step's greedy ids, alone and in a left-padded batch with stops."""
    from lmforge.runtime import compiler_available

    if not compiler_available(torch.device("cpu")):
        pytest.skip("no C++ compiler: generate.compile decodes eagerly here")
    m = model(seed=9)
    rows = prompts([1, 12, 5, 30], seed=10)
    stop = generate(m, rows[1:2], [], SamplingConfig(max_new_tokens=16, greedy=True), PAD)[0][6]
    for batch in (rows[:1], rows):
        for stops in ([], [stop]):
            eager = generate(m, batch, stops, SamplingConfig(max_new_tokens=16, greedy=True), PAD)
            compiled = generate(m, batch, stops, SamplingConfig(max_new_tokens=16, greedy=True, compile=True), PAD)
            assert compiled == eager, (len(batch), stops)
    assert "_compiled_decode" in m.__dict__


def _groups_of_prompts():
    """A tiny model and RL-like rows: two prompts of 7 and 3 tokens 4 times each, and a 5-token
    prefix of the first once (left padding around the groups)."""
    from lmforge.config import ModelConfig
    from lmforge.model import Transformer

    m = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=70, max_seq_len=64))
    m.reset_parameters(seed=5)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(3, 70, (7,), generator=g).tolist(), torch.randint(3, 70, (3,), generator=g).tolist()
    rows = [a] * 4 + [b] * 4 + [a[:5]]
    return m, rows


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_a_repeated_prompt_is_prefilled_once_with_the_same_samples(monkeypatch, penalty):
    """RL's groups: G rows of one prompt. The prompt is prefilled once and its cache rows copied
    (`KVCache.gather_rows`); the sampled ids and their log-probabilities equal those of a prefill of
    every row, bit for bit, for the same generator, with prompts of other lengths (left padding) around."""
    import lmforge.generate as gen
    from lmforge.config import SamplingConfig

    m, rows = _groups_of_prompts()
    cfg = SamplingConfig(max_new_tokens=12, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=penalty)
    calls = []
    real = m.hidden
    monkeypatch.setattr(m, "hidden", lambda tokens, *args, **kw: calls.append(tokens.shape[0]) or real(tokens, *args, **kw))
    shared = gen.generate(m, rows, [2], cfg, 0, generator=torch.Generator().manual_seed(3), return_logprobs=True)
    assert calls == [3]  # one prefill of the 3 distinct prompts
    monkeypatch.setattr(gen, "SHARE_PREFILL", False)
    each = gen.generate(m, rows, [2], cfg, 0, generator=torch.Generator().manual_seed(3), return_logprobs=True)
    assert calls == [3, 9]
    assert shared == each
    assert len({tuple(x) for x in shared[0][:4]}) > 1  # a group's rows still sample apart


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_stopped_rows_leave_the_batch_with_the_same_samples(monkeypatch, penalty):
    """Rows that stopped leave the decode batch (`generate.COMPACT_STOPPED`: their cache rows dropped);
    the rows still going get the same logits at the smaller batch (oneDNN's prepacked matmuls), so the
    ids and log-probabilities equal those of decoding every row to the end, bit for bit, for the same
    generator — left padding and repeated prompts included."""
    import lmforge.generate as gen
    from lmforge.config import SamplingConfig
    from lmforge.model import decode

    m, rows = _groups_of_prompts()
    cfg = SamplingConfig(max_new_tokens=24, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=penalty)
    stops = [2, 3, 4, 5, 6]  # ~7% a token: rows stop at many different steps
    batches = []
    real = decode.decode_step
    monkeypatch.setattr(decode, "decode_step", lambda m_, tokens, *a_, **kw: batches.append(tokens.shape[0]) or
                        real(m_, tokens, *a_, **kw))
    compact = gen.generate(m, rows, stops, cfg, 0, generator=torch.Generator().manual_seed(3), return_logprobs=True)
    shrunk = list(batches)
    batches.clear()
    monkeypatch.setattr(gen, "COMPACT_STOPPED", 0)
    full = gen.generate(m, rows, stops, cfg, 0, generator=torch.Generator().manual_seed(3), return_logprobs=True)
    assert set(batches) == {len(rows)}
    assert min(shrunk) < len(rows) // 2, shrunk  # the batch did shrink
    assert compact == full
    lengths = sorted(len(x) for x in full[0])
    assert lengths[0] < lengths[-1]  # rows stopped at different steps


def test_draw_follows_the_distribution_and_never_draws_a_zero():
    """`generate.draw` (inverse transform, one float64 uniform a row): frequencies within 5 sigma of
    the row's probabilities (unnormalised rows), an id of probability 0 never drawn, at either end."""
    from lmforge.generate import draw

    probs = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 3.0, 0.0],
                          [0.5, 0.0, 0.25, 0.0, 0.0, 0.25]])
    n = 200_000
    ids = draw(probs.repeat_interleave(n, 0), torch.Generator().manual_seed(0)).view(3, n)
    for row, p in zip(ids, probs):
        freq = torch.bincount(row, minlength=6).double() / n
        expect = p.double() / p.sum()
        sigma = (expect * (1 - expect) / n).sqrt()
        assert bool(((freq - expect).abs() <= 5 * sigma + 1e-12).all()), (freq, expect)
        assert bool((freq[expect == 0] == 0).all())


def test_draw_at_the_ends_of_the_unit_interval(monkeypatch):
    """u = 0 draws the first id of probability > 0; u just below 1 (u x total rounding up to the
    total) draws the last, never one past the end or a trailing id of probability 0."""
    import lmforge.generate as gen

    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0]])
    for u, expect in ((0.0, 1), (1.0 - 2.0 ** -53, 3), (1.0, 3)):
        monkeypatch.setattr(gen.torch, "rand", lambda *a, u=u, **kw: torch.full((1, 1), u, dtype=torch.float64))
        assert gen.draw(probs).tolist() == [expect]
