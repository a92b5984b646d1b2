"""train.activation_checkpointing: a training forward keeps each block's input only and recomputes
the block in backward; the same loss and gradients bit for bit (full and LoRA, packed rows), less
kept for backward, and one Trainer step through the config key equal to one without it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lmforge.config import LoRAConfig
from lmforge.data.conversations import Conversation, render_samples, sft_stream
from lmforge.model import Transformer, lora, resolve_model_config
from lmforge.model.memory import release_free_memory
from lmforge.train.distributed import DistInfo
from lmforge.train.trainer import Trainer


def short_conversations(n: int = 24) -> list[Conversation]:
    """Conversations of a few words each, several to a packed row."""
    words = ["value", "return", "self", "data", "items", "key", "name", "result"]
    return [Conversation(({"role": "user", "content": " ".join(words[(i + j) % 8] for j in range(1 + i % 3))},
                          {"role": "assistant", "content": " ".join(words[(3 * i + j) % 8] for j in range(1 + i % 4))}),
                         f"s{i}", f"s{i}") for i in range(n)]


def loss_and_grads(model: Transformer, batch, recompute: bool) -> tuple[torch.Tensor, dict, int]:
    """(summed loss, gradients by name, bytes of the tensors autograd keeps for backward)."""
    model.zero_grad(set_to_none=True)
    model.activation_checkpointing = recompute
    kept: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(batch.tokens, batch.positions, batch.document_ids, targets=batch.targets,
                     loss_mask=batch.loss_mask)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, \
        sum(kept.values())


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_recomputed_blocks_give_the_same_gradients_bit_for_bit_and_keep_less(tiny_run, adapters):
    cfg, tok = tiny_run
    model = Transformer(resolve_model_config(replace(cfg.model, n_layers=4), tok.contract))
    model.reset_parameters(seed=0)
    if adapters:
        lora.inject(model, LoRAConfig(rank=4, alpha=8.0), seed=0)
        for _, layer in lora.lora_layers(model):  # B = 0 would leave A without a gradient
            torch.nn.init.normal_(layer.lora_b, std=0.02)
    samples = render_samples(short_conversations(), tok, cfg.data.seq_len)
    batch = sft_stream(samples, cfg.data.seq_len, 4, tok.pad_id, seed=0, packing=True, shuffle=False).next_batch()
    assert int(batch.document_ids.max()) > 0  # packed: the document mask is in the recomputed blocks
    loss0, grads0, kept0 = loss_and_grads(model, batch, recompute=False)
    loss1, grads1, kept1 = loss_and_grads(model, batch, recompute=True)
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys() and len(grads0) > 0
    for name in grads0:
        assert torch.equal(grads0[name], grads1[name]), name
    if adapters:
        assert all(lora.is_adapter_key(n) for n in grads0)
    # kept for backward: the blocks' inputs instead of every block's tensors
    assert kept1 < 0.5 * kept0, (kept1, kept0)


def test_the_config_key_reaches_the_model_and_the_step_is_unchanged(tiny_run, tmp_path):
    cfg, tok = tiny_run
    init = Transformer(resolve_model_config(cfg.model, tok.contract)).state_dict()
    samples = render_samples(short_conversations(), tok, cfg.data.seq_len)
    after = {}
    for on in (False, True):
        c = replace(cfg, train=replace(cfg.train, micro_batch_size=4, precision="fp32", warmup_steps=0,
                                       activation_checkpointing=on))
        model = Transformer(resolve_model_config(c.model, tok.contract))
        model.load_state_dict(init)
        stream = sft_stream(samples, c.data.seq_len, 4, tok.pad_id, seed=0, packing=True, shuffle=False)
        trainer = Trainer(c, tmp_path / str(on), tok.folder, model, stream, None, DistInfo(), progress=False,
                          log=lambda m: None)
        assert trainer.raw_model.activation_checkpointing is on
        assert (trainer._trim is release_free_memory) is on  # the heap trimmed around each forward and backward
        trainer.train_step()
        after[on] = {n: p.detach().clone() for n, p in trainer.raw_model.named_parameters()}
    for name, w in after[False].items():
        assert torch.equal(w, after[True][name]), name
        assert not torch.equal(w, init[name]) or name.endswith("norm.weight"), name  # the step moved it
