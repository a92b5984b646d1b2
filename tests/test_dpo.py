"""DPO (`lmforge dpo`): the loss, the pairs, the reference, the loop — T9 to T14 of
shared/research/LORA-DPO.md, plus bad input, resume and the default pairs.

T9  the loss on torchtune's hand values
T10 policy == reference at step 0: loss ln 2, rewards and accuracy 0 (full and LoRA, live and
    precomputed reference)
T11 a tiny set (the Zen of Python, from the standard library's `this`) learned to reward
    accuracy 1, while the reference (adapters disabled) stays the initial model bit for bit
T12 the completion mask is exactly the final reply and its end-of-turn token; per-pair
    log-probabilities do not depend on padding or batch order; prompt ids equal on both sides
T13 a pair whose completion is cut away by truncation is dropped and counted, never trained
T14 two gloo ranks equal one process with twice the accumulation
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import io
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from lmforge.config import LoRAConfig
from lmforge.data.preferences import (PairStream, final_turn_mask, pair_batches, pair_from_record, read_pairs,
                                      render_pairs)
from lmforge.errors import ConfigError, DataError
from lmforge.model import Transformer, load_model, lora, resolve_model_config
from lmforge.model.io import MODEL_FILE, latest_checkpoint, load_weights
from lmforge.model.loss import dpo_loss
from lmforge.stages.dpo import dpo_stage
from lmforge.train.dpo import sequence_logps
from test_resume import read_metrics, sigterm_at

LN2 = math.log(2.0)


def zen_records() -> list[dict]:
    """The Zen of Python's "X is better than Y." lines: prompt "X is better than", chosen " Y.",
    rejected the next line's ending (a derangement)."""
    import this  # noqa: F401  (prints the Zen once on first import)

    with contextlib.redirect_stdout(io.StringIO()):
        text = codecs.decode(this.s, "rot13")
    lines = [line for line in text.splitlines() if " than " in line]
    out = []
    for i, line in enumerate(lines):
        head, tail = line.split(" than ", 1)
        out.append({"prompt": head + " than", "chosen": tail, "rejected": lines[(i + 1) % len(lines)].split(" than ", 1)[1]})
    return out


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def dpo_cfg(cfg, init, data, lora_rank=0, **dpo):
    base = dict(init=str(init), data=str(data), steps=4, micro_batch_size=4, grad_accum_steps=1, lr=1e-2,
                warmup_steps=1, val_examples=0)
    base.update(dpo)
    return replace(cfg, dpo=replace(cfg.dpo, **base), data=replace(cfg.data, val_fraction=0.0),
                   train=replace(cfg.train, optimizer="adamw", checkpoint_every=0, keep_last=0),
                   lora=LoRAConfig(rank=lora_rank, alpha=8.0) if lora_rank else cfg.lora)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- T9 ----------------------------------------------------------------------------------------
def test_t9_the_loss_on_hand_computed_values():
    """torchtune's test_dpo_loss: logits (policy - reference log-ratios) 0, 10, 20 -> beta 0.1 ->
    -log sigmoid([0, 1, 2])."""
    pc, pr = torch.tensor([-0.5, -10.0, -1.0]), torch.tensor([-0.1, -30.0, -21.0])
    rc, rr = torch.tensor([-0.5, -10.1, -0.1]), torch.tensor([-0.1, -20.1, -0.1])
    losses, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta=0.1)
    assert torch.allclose(losses, torch.tensor([0.6931, 0.3133, 0.1269]), atol=1e-4)
    assert torch.allclose(chosen, 0.1 * (pc - rc)) and torch.allclose(rejected, 0.1 * (pr - rr))
    ipo, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, kind="ipo")
    assert torch.allclose(ipo, (torch.tensor([0.0, 10.0, 20.0]) - 5.0) ** 2, atol=1e-4)


# -- T10 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("lora_rank, reference", [(0, "live"), (0, "precomputed"), (4, "live"),
                                                  (4, "precomputed")])
def test_t10_step_0_is_ln2_with_zero_rewards(tiny_run, init_ckpt, tmp_path, lora_rank, reference):
    cfg, _ = tiny_run
    data = write_jsonl(tmp_path / "zen.jsonl", zen_records())
    dpo_stage(dpo_cfg(cfg, init_ckpt, data, lora_rank, steps=1, reference=reference), tmp_path / "dpo",
              progress=False)
    first = read_metrics(tmp_path / "dpo")[0]
    assert abs(first["loss"] - LN2) < 1e-6, first
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(first[key]) < 1e-6, (key, first)
    assert first["rewards/accuracies"] == 0.0  # strictly greater: none at step 0
    assert first["logps/chosen"] < 0 and first["logps/rejected"] < 0
    assert first["supervised"] == 4  # counted in pairs


# -- T11 ---------------------------------------------------------------------------------------
def test_t11_a_tiny_set_is_learned_and_the_reference_stays_the_initial_model(tiny_run, init_ckpt, tmp_path):
    cfg, tok = tiny_run
    data = write_jsonl(tmp_path / "zen.jsonl", zen_records())
    before = sha(init_ckpt / MODEL_FILE)
    c = dpo_cfg(cfg, init_ckpt, data, 4, steps=40, micro_batch_size=8, lr=1e-2)
    last = dpo_stage(c, tmp_path / "dpo", progress=False)
    assert last["loss"] < LN2 - 0.15 and last["rewards/accuracies"] == 1.0, last
    assert sha(init_ckpt / MODEL_FILE) == before
    # the adapters as trained, on the initial weights: disabled, they are the initial model exactly
    init_model = load_model(init_ckpt)[0]
    adapted = load_model(init_ckpt)[0]
    lora.inject(adapted, c.lora)
    load_weights(adapted, latest_checkpoint(tmp_path / "dpo") / MODEL_FILE)
    samples = render_pairs([pair_from_record(r, "zen") for r in zen_records()], tok, c.data.seq_len)
    batch = next(iter(pair_batches(samples, c.data.seq_len, len(samples), tok.pad_id)))
    with torch.no_grad():
        ref_c, ref_r = sequence_logps(init_model, batch)
        with lora.adapters_disabled(adapted):
            dis_c, dis_r = sequence_logps(adapted, batch)
        pol_c, pol_r = sequence_logps(adapted, batch)
    assert torch.equal(dis_c, ref_c) and torch.equal(dis_r, ref_r)
    margin = (pol_c - ref_c) - (pol_r - ref_r)
    assert bool((margin > 0).all()), margin  # every pair ranked right against the reference


def test_dpo_with_lora_refuses_dropout_and_a_trainable_base(tiny_run, init_ckpt, tmp_path):
    cfg, _ = tiny_run
    data = write_jsonl(tmp_path / "zen.jsonl", zen_records())
    c = dpo_cfg(cfg, init_ckpt, data, 4)
    with pytest.raises(ConfigError, match="lora.dropout = 0.1: DPO compares"):
        dpo_stage(replace(c, lora=replace(c.lora, dropout=0.1)), tmp_path / "dpo", progress=False)
    assert not (tmp_path / "dpo").exists()
    from lmforge.train.dpo import check_only_adapters_train

    model = load_model(init_ckpt)[0]
    lora.inject(model, c.lora)
    model.output.weight.requires_grad_(True)
    with pytest.raises(ConfigError, match="output.weight .* also trains"):
        check_only_adapters_train(model)


# -- T12 ---------------------------------------------------------------------------------------
def test_t12_the_mask_is_the_final_reply_and_its_end_of_turn_token(tiny_run):
    _, tok = tiny_run
    record = {"chosen": [{"role": "user", "content": "first question"},
                         {"role": "assistant", "content": "an earlier answer"},
                         {"role": "user", "content": "second question"},
                         {"role": "assistant", "content": "good reply"}],
              "rejected": [{"role": "user", "content": "first question"},
                           {"role": "assistant", "content": "an earlier answer"},
                           {"role": "user", "content": "second question"},
                           {"role": "assistant", "content": "bad"}]}
    pair = pair_from_record(record, "t.jsonl:1")
    samples = render_pairs([pair], tok, 512)
    for side, reply in (("chosen", "good reply"), ("rejected", "bad")):
        ids, mask = samples.ids[side][0], samples.mask[side][0]
        assert tok.decode(ids[mask].tolist(), skip_special_tokens=False) == reply + "<|im_end|>"
        full = tok.render_chat(pair.messages(side))
        assert np.array_equal(mask, final_turn_mask(np.asarray(full.loss_mask, dtype=bool)))
        assert int(np.asarray(full.loss_mask)[: samples.prompt_len[0]].sum()) > 0  # the earlier answer: not in it
    p = samples.prompt_len[0]
    assert np.array_equal(samples.ids["chosen"][0][:p], samples.ids["rejected"][0][:p])


@pytest.mark.parametrize("packing", [False, True])
def test_t12_pair_logps_do_not_depend_on_padding_or_batch_order(tiny_run, packing):
    """Each pair's two log-probabilities, scored alone in rows just wide enough, equal those of
    the same pair in shuffled micro-batches of 3 and of every pair: right-padded one side a row,
    or packed (each side its own segment among other pairs' sides)."""
    cfg, tok = tiny_run
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    model.reset_parameters(seed=1)
    model.eval()
    pairs = [pair_from_record(r, f"zen:{i}") for i, r in enumerate(zen_records())]
    samples = render_pairs(pairs, tok, 64)
    alone = {}
    with torch.no_grad():
        for i in range(len(samples)):  # one pair a batch, in a row only as wide as it needs
            sub = render_pairs([pairs[i]], tok, 64)
            width = int(sub.n_pairs[0])
            b = next(iter(pair_batches(sub, width, 1, tok.pad_id, packing=False)))
            alone[i] = torch.stack(sequence_logps(model, b)).squeeze(1)
        for batch_size, seed in ((3, 0), (len(samples), 5)):
            # packed rows of 128: two sides of up to 64 pairs each fit one
            stream = PairStream(samples, 128 if packing else 64, batch_size, tok.pad_id, seed=seed, packing=packing)
            for _ in range(3):
                b = stream.next_batch()
                assert b.tokens.shape[0] <= batch_size + 1 if packing else b.tokens.shape[0] == 2 * batch_size
                c, r = sequence_logps(model, b)
                for k, i in enumerate(b.pair_index.tolist()):
                    assert torch.allclose(torch.stack([c[k], r[k]]), alone[i], atol=1e-4), (i, batch_size)


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FlexAttention backward)")
def test_cuda_flex_packed_pair_logps_and_gradients_equal_each_pair_alone(tiny_run):
    """On CUDA, fp32 without TF32, the path `attention = "auto"` takes there: FlexAttention over
    packed pair rows gives each side's log-probability and the gradient of their sum that sdpa gives
    the pairs one a row."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg, tok = tiny_run
    # head_dim 16: FlexAttention's kernel needs at least 16 (the tiny model's 8 resolves to sdpa)
    model = Transformer(resolve_model_config(replace(cfg.model, n_heads=2, n_kv_heads=1), tok.contract))
    model.reset_parameters(seed=1)
    model = model.cuda()
    pairs = [pair_from_record(r, f"zen:{i}") for i, r in enumerate(zen_records())]
    samples = render_pairs(pairs, tok, 64)
    stream = PairStream(samples, 128, 6, tok.pad_id, seed=2, packing=True)
    b = stream.next_batch().to("cuda")
    model.set_attention("flex")
    model.zero_grad()
    c, r = sequence_logps(model, b)
    (c.sum() + r.sum()).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.set_attention("sdpa")
    model.zero_grad()
    total = 0.0
    for k, i in enumerate(b.pair_index.tolist()):
        sub = render_pairs([pairs[i]], tok, 64)
        one = next(iter(pair_batches(sub, int(sub.n_pairs[0]), 1, tok.pad_id, packing=False))).to("cuda")
        c1, r1 = sequence_logps(model, one)
        assert abs(float(c1[0]) - float(c[k])) <= 1e-4 and abs(float(r1[0]) - float(r[k])) <= 1e-4, i
        total = total + c1.sum() + r1.sum()
    total.backward()
    for n, p in model.named_parameters():
        assert float((p.grad - packed_grads[n]).abs().max()) <= 1e-4, n


def test_packed_pair_rows_hold_each_side_once_as_its_own_segment(tiny_run):
    """dpo.packing's layout: every side of the micro-batch's pairs lies whole in one segment of
    one row (its slots named by `groups`, its positions from 0, its targets and loss mask those
    of the side alone), no segment holds two sides, and the padding is what is left."""
    _, tok = tiny_run
    records = zen_records()
    samples = render_pairs([pair_from_record(r, f"zen:{i}") for i, r in enumerate(records)], tok, 64)
    stream = PairStream(samples, 128, 7, tok.pad_id, seed=3, packing=True)
    padded = PairStream(samples, 128, 7, tok.pad_id, seed=3, packing=False)
    for _ in range(4):
        b, q = stream.next_batch(), padded.next_batch()
        assert torch.equal(b.pair_index, q.pair_index) and torch.equal(b.completion_tokens, q.completion_tokens)
        P = b.n_pairs
        seen = set()
        for row in range(b.tokens.shape[0]):
            for d in b.document_ids[row].unique().tolist():
                where = (b.document_ids[row] == d).nonzero().flatten()
                side = b.groups[row, where].unique().tolist()
                if not bool(b.loss_mask[row, where].any()) and int(b.tokens[row, where[0]]) == tok.pad_id:
                    continue  # the padding after the last side
                assert len(side) == 1 and side[0] not in seen
                seen.add(side[0])
                j = side[0]
                k, which = j % P, ("chosen", "rejected")[j // P]
                ids = samples.ids[which][int(b.pair_index[k])]
                mask = samples.mask[which][int(b.pair_index[k])]
                assert torch.equal(b.positions[row, where], torch.arange(len(ids) - 1))
                assert b.tokens[row, where].tolist() == ids[:-1].tolist()
                assert b.targets[row, where].tolist() == ids[1:].tolist()
                assert b.loss_mask[row, where].tolist() == mask[1:].tolist()
                assert int(b.loss_mask[row, where].sum()) == int(b.completion_tokens[j])
        assert seen == set(range(2 * P))
        assert b.tokens.numel() < q.tokens.numel()
    assert stream.padding_fraction() < padded.padding_fraction()


def test_packed_and_padded_dpo_runs_take_the_same_steps(tiny_run, init_ckpt, tmp_path):
    """dpo.packing changes the layout, not the training: the same pairs in each micro-batch, the
    same loss, rewards and weights, step after step (float32; float tolerance), in fewer rows."""
    cfg, _ = tiny_run
    data = write_jsonl(tmp_path / "zen.jsonl", zen_records())
    runs = {}
    for packing in (False, True):
        c = dpo_cfg(cfg, init_ckpt, data, steps=4, micro_batch_size=5, packing=packing)
        c = replace(c, train=replace(c.train, precision="fp32"), data=replace(c.data, seq_len=128))
        dpo_stage(c, tmp_path / str(packing), progress=False)
        runs[packing] = read_metrics(tmp_path / str(packing))
    for x, y in zip(runs[False], runs[True], strict=True):
        for key in ("loss", "rewards/margins", "logps/chosen", "logps/rejected", "supervised"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-5), (key, x, y)
    wa = load_file(str(latest_checkpoint(tmp_path / "False") / MODEL_FILE))
    wb = load_file(str(latest_checkpoint(tmp_path / "True") / MODEL_FILE))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4
    info = {p: json.loads((tmp_path / str(p) / "dpo_data.json").read_text()) for p in (False, True)}
    assert info[True]["packing"] and info[True]["padding_fraction"] < info[False]["padding_fraction"]


def test_an_imported_template_masks_the_final_reply_and_refuses_prompts_that_differ(tmp_path):
    """SmolLM2's ChatML (a default system prompt; GPT-2's byte-level split, so a reply's leading
    spaces merge with the header's newline): the final reply is masked exactly, and a pair
    whose replies change the prompt's last token is refused."""
    from hf_families import build_tokenizer
    from lmforge.stages.tokenizer import import_tokenizer

    build_tokenizer("smollm", tmp_path / "hf")
    tok = import_tokenizer(tmp_path / "hf", tmp_path / "tok")
    good = pair_from_record({"prompt": "add two numbers", "chosen": "return a + b", "rejected": "return a - b"},
                            "t.jsonl:1")
    samples = render_pairs([good], tok, 512)
    for side, reply in (("chosen", "return a + b"), ("rejected", "return a - b")):
        ids, mask = samples.ids[side][0], samples.mask[side][0]
        assert tok.decode(ids[mask].tolist(), skip_special_tokens=False) == reply + "<|im_end|>"
    bad = pair_from_record({"prompt": "q", "chosen": "   indented", "rejected": "plain"}, "t.jsonl:3")
    with pytest.raises(DataError, match=r"t.jsonl:3: the prompt renders to different tokens"):
        render_pairs([bad], tok, 512)


# -- T13 ---------------------------------------------------------------------------------------
def test_t13_pairs_cut_away_by_truncation_are_dropped_and_counted(tiny_run, init_ckpt, tmp_path):
    cfg, tok = tiny_run
    long_prompt = "word " * 200  # longer than seq_len 64: nothing of either reply is left
    records = zen_records() + [{"prompt": long_prompt, "chosen": "yes", "rejected": "no"}]
    samples = render_pairs([pair_from_record(r, "x") for r in records], tok, 64)
    assert samples.counts()["dropped_empty"] == 1 and len(samples) == len(records) - 1
    data = write_jsonl(tmp_path / "pairs.jsonl", records)
    dpo_stage(dpo_cfg(cfg, init_ckpt, data, steps=2), tmp_path / "dpo", progress=False)
    counts = json.loads((tmp_path / "dpo" / "dpo_data.json").read_text())["splits"]["train"]
    assert counts["dropped_empty"] == 1 and counts["kept"] == len(records) - 1
    only_long = write_jsonl(tmp_path / "long.jsonl", records[-1:])
    with pytest.raises(DataError, match="no preference pair left to train on"):
        dpo_stage(dpo_cfg(cfg, init_ckpt, only_long, steps=2), tmp_path / "dpo2", progress=False)
    assert not (tmp_path / "dpo2").exists()


# -- T14 ---------------------------------------------------------------------------------------
def test_t14_two_ranks_equal_one_process_with_twice_the_accumulation(tiny_run, init_ckpt, tmp_path):
    from test_distributed import run_ranks

    cfg, _ = tiny_run
    data = write_jsonl(tmp_path / "zen.jsonl", zen_records() * 2)
    two = dpo_cfg(cfg, init_ckpt, data, steps=3, micro_batch_size=2, grad_accum_steps=1)
    run_ranks(2, [{"cfg": two, "out": tmp_path / "two", "stage": "dpo"}])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks
    try:
        dpo_stage(dpo_cfg(cfg, init_ckpt, data, steps=3, micro_batch_size=2, grad_accum_steps=2), tmp_path / "one",
                  progress=False)
    finally:
        torch.set_num_threads(threads)
    a, b = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
    for x, y in zip(a, b):
        for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen"):
            assert abs(x[key] - y[key]) < 1e-5, (key, x, y)
    wa = load_file(str(latest_checkpoint(tmp_path / "two") / MODEL_FILE))
    wb = load_file(str(latest_checkpoint(tmp_path / "one") / MODEL_FILE))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


# -- resume, consumers ---------------------------------------------------------------------------
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_dpo_resume_is_exact(tiny_run, init_ckpt, tmp_path, monkeypatch, lora_rank):
    cfg, _ = tiny_run
    data = write_jsonl(tmp_path / "zen.jsonl", zen_records())
    c = dpo_cfg(cfg, init_ckpt, data, lora_rank, steps=6)
    dpo_stage(c, tmp_path / "straight", progress=False)
    with monkeypatch.context() as m:
        sigterm_at(m, 3)
        last = dpo_stage(c, tmp_path / "resumed", progress=False)
    assert last["step"] == 3 and last.get("interrupted")
    dpo_stage(c, tmp_path / "resumed", resume=True, progress=False)
    assert read_metrics(tmp_path / "straight") == [
        {**r, "tokens_per_s": s["tokens_per_s"], "elapsed_s": s["elapsed_s"]}
        for r, s in zip(read_metrics(tmp_path / "resumed"), read_metrics(tmp_path / "straight"))]
    wa = load_file(str(latest_checkpoint(tmp_path / "straight") / MODEL_FILE))
    wb = load_file(str(latest_checkpoint(tmp_path / "resumed") / MODEL_FILE))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    if lora_rank:
        assert all(lora.is_adapter_key(k) for k in wa)  # adapters only
    with pytest.raises(Exception, match="dpo.beta"):  # another loss cannot continue the run
        dpo_stage(replace(c, dpo=replace(c.dpo, beta=0.5, steps=8)), tmp_path / "resumed", resume=True,
                  progress=False)


def test_a_dpo_checkpoint_is_taken_by_eval_generate_and_export(tiny_run, init_ckpt, tmp_path):
    from lmforge.stages import export_stage, generate_stage

    cfg, tok = tiny_run
    data = write_jsonl(tmp_path / "zen.jsonl", zen_records())
    dpo_stage(dpo_cfg(cfg, init_ckpt, data, 4, steps=2), tmp_path / "dpo", progress=False)
    merged = load_model(tmp_path / "dpo")[0]
    assert not lora.has_adapters(merged)
    text = generate_stage(cfg, tmp_path / "dpo", "Beautiful is", replace(cfg.generate, max_new_tokens=4, greedy=True))
    assert isinstance(text, str)
    export_stage(tmp_path / "dpo", tmp_path / "hf", fmt="hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()


# -- data ----------------------------------------------------------------------------------------
BAD = [
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}],
      "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "y"}]},
     r"pairs.jsonl:1: the prompts of chosen and rejected differ \(at message 0\)"),
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"},
                 {"role": "user", "content": "more"}],
      "rejected": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "y"}]},
     r"pairs.jsonl:1: chosen ends on a 'user' turn"),
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, r"pairs.jsonl:1: chosen and rejected are the same reply"),
    ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "chosen": "x",
      "rejected": "y"}, r"pairs.jsonl:1: the prompt ends on an 'assistant' turn"),
    ({"prompt": "q", "chosen": [{"role": "assistant", "content": "x"}, {"role": "assistant", "content": "z"}],
      "rejected": "y"}, r"pairs.jsonl:1: chosen holds 2 messages"),
    ({"prompt": "q", "chosen": 3, "rejected": "y"}, r"pairs.jsonl:1: chosen: \"messages\" must be a non-empty list"),
    ({"prompt": "q", "chosen": "x"}, r"pairs.jsonl:1: a preference record with keys \['chosen', 'prompt'\]"),
    ({"prompt": "q", "chosen": "x", "rejected": "y", "mutation": 4}, r"\"mutation\" is 4; expected a string"),
]


@pytest.mark.parametrize("record, message", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_pairs_are_refused_with_file_and_line(tiny_run, init_ckpt, tmp_path, record, message):
    cfg, _ = tiny_run
    data = write_jsonl(tmp_path / "pairs.jsonl", [record] + zen_records())
    before = sha(data)
    with pytest.raises(DataError, match=message):
        dpo_stage(dpo_cfg(cfg, init_ckpt, data), tmp_path / "dpo", progress=False)
    assert not (tmp_path / "dpo").exists() and sha(data) == before


def test_both_forms_and_strings_read_as_one_pair(tmp_path):
    explicit = {"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "x"}],
                "rejected": [{"role": "assistant", "content": "y"}], "extra": 1}
    implicit = {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}],
                "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "y"}]}
    strings = {"prompt": "q", "chosen": "x", "rejected": "y"}
    pairs = read_pairs(write_jsonl(tmp_path / "p.jsonl", [explicit, implicit, strings]))
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [(({"role": "user", "content": "q"},), "x", "y")] * 3
    assert [p.name for p in pairs] == [f"{tmp_path / 'p.jsonl'}:{i}" for i in (1, 2, 3)]


def test_a_missing_or_empty_dpo_init_is_refused(tiny_run, tmp_path):
    cfg, _ = tiny_run
    with pytest.raises(ConfigError, match="dpo.init is empty"):
        dpo_stage(cfg, tmp_path / "dpo", progress=False)


# -- validation per kind on the default pairs (issue 28) --------------------------------------------
def test_validation_per_kind_on_the_default_pairs_equals_a_recount(tiny_run, init_ckpt, tmp_path):
    """`lmforge dpo` on the embedded pairs (several mutation kinds) through its validation: every
    `val_pairwise_accuracy/KIND` and `val_pairs/KIND` equals a recount from per-pair
    log-probabilities of the final weights, the kinds' pairs add up to every held-out pair, and
    the overall accuracy is their weighted mean. (The per-kind totals were one slot short: an
    IndexError at the first validation.)"""
    from lmforge.stages.dpo import load_pairs

    cfg, tok = tiny_run
    c = dpo_cfg(cfg, init_ckpt, "stdlib", steps=2, max_examples=24, max_chars=400, micro_batch_size=4)
    c = replace(c, data=replace(c.data, val_fraction=0.2, seq_len=128), model=replace(c.model, max_seq_len=128))
    last = dpo_stage(c, tmp_path / "dpo", progress=False)
    pairs, _ = load_pairs(replace(c, data=replace(c.data, seq_len=128)))
    val = render_pairs(pairs["val"], tok, 128)
    kinds = sorted(set(val.mutations))
    assert len(kinds) >= 3 and "" not in kinds, kinds
    model = load_model(tmp_path / "dpo")[0].eval()
    pc, pr = [], []
    with torch.no_grad():
        for b in pair_batches(val, 128, 5, tok.pad_id):  # another batch size than the run's
            c_, r_ = sequence_logps(model, b)
            pc += c_.tolist()
            pr += r_.tolist()
    correct = [a > b for a, b in zip(pc, pr)]
    assert len(correct) == len(val.mutations)
    assert sum(last[f"val_pairs/{k}"] for k in kinds) == len(val) > 0
    assert not [k for k in last if k.startswith("val_pairs/") and k[len("val_pairs/"):] not in kinds]
    for k in kinds:
        sel = [ok for ok, m in zip(correct, val.mutations) if m == k]
        assert last[f"val_pairs/{k}"] == len(sel), k
        assert last[f"val_pairwise_accuracy/{k}"] == pytest.approx(sum(sel) / len(sel), abs=1e-12), k
    assert last["val_pairwise_accuracy"] == pytest.approx(sum(correct) / len(correct), abs=1e-12)
    row = read_metrics(tmp_path / "dpo")[-1]  # and the same numbers in metrics.jsonl
    assert all(row[f"val_pairwise_accuracy/{k}"] == last[f"val_pairwise_accuracy/{k}"] for k in kinds)


# -- reference-free losses: SimPO and ORPO (issue 29) ---------------------------------------------
def test_simpo_and_orpo_on_hand_computed_values():
    """SimPO (Meng et al. 2024, eq. 6) and ORPO (Hong et al. 2024, eqs. 4-7) on mean per-token
    log-probabilities, against a float64 recomputation with `math` and the hand values."""
    from lmforge.model.loss import reference_free_loss

    c, r = torch.tensor([-1.0, -0.5, -0.2]), torch.tensor([-2.0, -1.5, -0.1])

    def log_sigmoid(x):
        return -math.log1p(math.exp(-x))

    def log_odds(p):
        return p - math.log1p(-math.exp(p))

    simpo, rc, rr = reference_free_loss(c, r, beta=2.0, kind="simpo", gamma=0.5)
    want = [-log_sigmoid(2.0 * (a - b) - 0.5) for a, b in zip(c.tolist(), r.tolist())]
    assert torch.allclose(simpo.double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)
    assert abs(float(simpo[0]) - 0.2014133) < 1e-6  # -log sigmoid(1.5)
    assert torch.equal(rc, 2.0 * c) and torch.equal(rr, 2.0 * r)
    orpo, _, _ = reference_free_loss(c, r, beta=0.1, kind="orpo")
    want = [-a - 0.1 * log_sigmoid(log_odds(a) - log_odds(b)) for a, b in zip(c.tolist(), r.tolist())]
    assert torch.allclose(orpo.double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)
    assert abs(float(orpo[1]) - 0.5170840) < 1e-5  # 0.5 + 0.1 x -log sigmoid(0.43275 + 1.24752)


@pytest.mark.parametrize("kind", ["simpo", "orpo"])
def test_reference_free_losses_learn_the_zen_pairs_without_a_reference(tiny_run, init_ckpt, tmp_path, monkeypatch,
                                                                        kind):
    import lmforge.stages.dpo as stage

    def no_reference(*a, **k):
        raise AssertionError("a reference-free loss built a reference model")

    monkeypatch.setattr(stage, "live_reference", no_reference)
    cfg, _ = tiny_run
    data = write_jsonl(tmp_path / "zen.jsonl", zen_records())  # TRL's explicit form
    beta = 2.0 if kind == "simpo" else 1.0  # ORPO's lambda raised from 0.1, so the odds-ratio term shows in 30 steps
    last = dpo_stage(dpo_cfg(cfg, init_ckpt, data, steps=30, loss=kind, beta=beta, lr=3e-3), tmp_path / "run",
                     progress=False)
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.1, [r["loss"] for r in rows]
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"] + 0.1, (rows[0], rows[-1])
    assert last["rewards/accuracies"] == 1.0


@pytest.mark.parametrize("kind", ["simpo", "orpo"])
def test_reference_free_losses_on_the_default_pairs_resume_exactly(tiny_run, init_ckpt, tmp_path, monkeypatch, kind):
    cfg, _ = tiny_run
    c = dpo_cfg(cfg, init_ckpt, "stdlib", steps=4, max_examples=16, max_chars=400, loss=kind, val_examples=8)
    c = replace(c, data=replace(c.data, val_fraction=0.2, seq_len=128), model=replace(c.model, max_seq_len=128))
    dpo_stage(c, tmp_path / "straight", progress=False)
    with monkeypatch.context() as m:
        sigterm_at(m, 2)
        assert dpo_stage(c, tmp_path / "resumed", progress=False)["step"] == 2
    dpo_stage(c, tmp_path / "resumed", resume=True, progress=False)
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert any(k.startswith("val_pairwise_accuracy/") for k in a[-1])  # per-kind validation, no reference
    wa = load_file(str(latest_checkpoint(tmp_path / "straight") / MODEL_FILE))
    wb = load_file(str(latest_checkpoint(tmp_path / "resumed") / MODEL_FILE))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_orpo_on_two_ranks_equals_one_process_with_twice_the_accumulation(tiny_run, init_ckpt, tmp_path):
    from test_distributed import run_ranks

    cfg, _ = tiny_run
    data = write_jsonl(tmp_path / "zen.jsonl", zen_records() * 2)
    two = dpo_cfg(cfg, init_ckpt, data, steps=3, micro_batch_size=2, grad_accum_steps=1, loss="orpo")
    run_ranks(2, [{"cfg": two, "out": tmp_path / "two", "stage": "dpo"}])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dpo_stage(dpo_cfg(cfg, init_ckpt, data, steps=3, micro_batch_size=2, grad_accum_steps=2, loss="orpo"),
                  tmp_path / "one", progress=False)
    finally:
        torch.set_num_threads(threads)
    for x, y in zip(read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")):
        for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen"):
            assert abs(x[key] - y[key]) < 1e-5, (key, x, y)
