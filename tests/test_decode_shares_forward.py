"""The fused decode step is built from what the forward is built from (issue 54, "a mechanism is
one code site"): the mechanisms are the functions of `lmforge.model.functional`, which both call,
and the decode step reads the model's own modules (an absent norm is the model's nn.Identity, a
bias the model's nn.Linear bias, the activation the model's), never a mechanism's config field. So
a change to a Block reaches decoding without an edit to decode.py."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from lmforge.config import ModelConfig
from lmforge.model import Transformer, attention, decode, functional, transformer
from lmforge.model.transformer import RMSNorm

VOCAB, MAX_LEN = 200, 64

#: ModelConfig fields that select a mechanism: decode.py reads none of them (shapes only).
MECHANISM_FIELDS = {"norm_offset", "norm_placement", "qk_norm_scope", "qkv_bias", "mlp_activation", "embed_scale",
                    "attn_scale", "attn_softcap", "final_softcap", "layer_types", "sliding_window",
                    "rope_theta_sliding", "nope_layers", "tie_embeddings", "rope_scaling"}


def test_forward_and_decode_call_the_same_mechanisms():
    shared = {"transformer": ("rms_norm", "sublayer", "qk_norm", "apply_rope", "scale_embedding", "softcap"),
              "decode": ("norm_gain", "norm_of", "FoldedNorm", "sublayer", "qk_norm", "apply_rope", "key_allowed",
                         "softcap"),
              "attention": ("key_allowed",)}
    modules = {"transformer": transformer, "decode": decode, "attention": attention}
    for module, names in shared.items():
        for name in names:
            assert getattr(modules[module], name) is getattr(functional, name), (module, name)


def test_decode_reads_no_mechanism_config_field():
    tree = ast.parse(Path(decode.__file__).read_text(encoding="utf-8"))
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not read & MECHANISM_FIELDS, sorted(read & MECHANISM_FIELDS)


def test_a_change_to_a_block_reaches_the_decode_step():
    """Norms after each sublayer on a "pre" model, a bias on wo, GELU instead of SiLU: none of them
    a config option, all of them in the forward; the decode step follows (fp32, 1e-5)."""
    cfg = ModelConfig(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=MAX_LEN)
    m = Transformer(cfg)
    m.reset_parameters(seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        change_blocks(m, g)
    m.eval()
    with torch.inference_mode():
        seq = torch.randint(1, VOCAB, (7,), generator=g).tolist()
        cache = m.new_cache(1, MAX_LEN)
        logits = m(torch.tensor([seq]), cache=cache)[:, -1]
        for _ in range(4):
            nxt = logits.argmax(-1)
            seq.append(int(nxt))
            logits = m.decode_step(nxt, torch.tensor([len(seq) - 1]), cache)
            torch.testing.assert_close(logits[0], m(torch.tensor([seq]))[0, -1], rtol=1e-5, atol=1e-5)


def change_blocks(m: Transformer, g: torch.Generator) -> None:
    cfg = m.config
    for block in m.layers:
        for name in ("attention_post_norm", "ffn_post_norm"):
            norm = RMSNorm(cfg.dim, cfg.norm_eps)
            norm.weight.copy_(torch.rand(cfg.dim, generator=g) + 0.5)
            setattr(block, name, norm)
        wo = block.attention.wo
        block.attention.wo = nn.Linear(wo.in_features, wo.out_features, bias=True)
        block.attention.wo.weight.copy_(wo.weight)
        block.attention.wo.bias.copy_(torch.randn(wo.out_features, generator=g) * 0.1)
        block.feed_forward.act = F.gelu
