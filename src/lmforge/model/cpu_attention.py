"""Attention for compiled bf16 training on CPU: sdpa's CPU flash forward with FlashAttention's
backward written as whole batched matrix products (`cpu_attention`, `_CpuAttention`), its switch
and size cap (CPU_ATTENTION, CPU_ATTENTION_MAX_SCORES), and when it serves
(`cpu_attention_applies`). `attention.sdpa_attend` routes a call here
(`attention._takes_cpu_attention`); `attention.prepare_mask` keeps the document mask where it
serves (one compiled graph).
"""

from __future__ import annotations

import torch

#: Off: every CPU training step takes F.scaled_dot_product_attention's own backward (the
#: benchmarks flip it to compare; bench/bench_train.py --attention-backward).
CPU_ATTENTION = True
#: The most score elements (B x H x T x S) one layer's backward may hold: ~14 bytes each while it
#: runs (float32 scores and probabilities, bf16 copies), so at most ~235 MB (the recipe's 16 x 256
#: rows: 4.2M, 59 MB). Larger batches of longer rows go through sdpa's own backward, whose memory
#: does not grow with T x S.
CPU_ATTENTION_MAX_SCORES = 1 << 24


def cpu_attention_applies(device: torch.device, dtype: torch.dtype, scores: int) -> bool:
    """The setting `cpu_attention` serves: switched on, under torch.compile (eager, its
    backward's elementwise work unfused is slower than sdpa's), on CPU, bf16, gradients
    enabled, at most CPU_ATTENTION_MAX_SCORES score elements (B x H x T x S)."""
    return (CPU_ATTENTION and torch.compiler.is_compiling() and device.type == "cpu"
            and dtype == torch.bfloat16 and torch.is_grad_enabled() and scores <= CPU_ATTENTION_MAX_SCORES)


def _bf16_parts(x: torch.Tensor) -> torch.Tensor:
    """float32 (...) -> bf16 (..., 2) whose sum is x to ~16 bits (a value carried through a
    bf16 matrix product's float32 accumulator as two columns)."""
    hi = x.to(torch.bfloat16)
    return torch.stack((hi, (x - hi.float()).to(torch.bfloat16)), -1)


class _CpuAttention(torch.autograd.Function):
    """Attention whose forward is sdpa's CPU flash kernel (the same output, and its per-row
    log-sum-exp) and whose backward is FlashAttention's (Dao et al. 2022, Algorithm 2) written
    as whole batched matrix products for inductor to fuse around: on a 2-core Xeon at the
    recipe's shape (16 x 256 tokens, 4/2 heads of 64, bf16) forward + backward of one layer
    take 0.72x (plain causal rows) and 0.53x (document masks) the time of sdpa's with torch
    2.13's CPU flash backward (bench/RESULTS.md, 2026-11-26).

    Precision as the flash kernel's: the scores are recomputed in float32 (bf16 scores would
    put |s| x 2^-9 into every probability); dP - delta comes out of one product's float32
    accumulator ([dO, -delta] . [V, 1], delta in two bf16 parts); dS and P enter the
    products as bf16, as in the flash kernel. Memory: float32 (B, H, T, S) scores per layer
    during the backward, hence CPU_ATTENTION_MAX_SCORES.
    """

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, scale=None):
        group = q.shape[1] // k.shape[1]
        ke, ve = (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) if group > 1 else (k, v)
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        additive = None
        if attn_mask is None:
            out, lse = flash(q, ke, ve, is_causal=True, scale=scale)
        else:  # the kernel takes an additive mask of q's dtype; the backward reuses it
            additive = (torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~attn_mask, float("-inf"))
                        if attn_mask.dtype == torch.bool else attn_mask.to(q.dtype))
            out, lse = flash(q, ke, ve, attn_mask=additive, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, additive)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, additive = ctx.saved_tensors
        B, H, T, D = q.shape
        KV, S = k.shape[1], k.shape[2]
        G = H // KV
        scale = D ** -0.5 if ctx.scale is None else ctx.scale
        qg = q.reshape(B, KV, G * T, D)  # each KV head's G query heads as one (G*T, D) matrix
        # P again: float32 scores minus the forward's log-sum-exp, masked
        x = ((qg.float() * scale) @ k.float().mT).view(B, KV, G, T, S) - lse.view(B, KV, G, T, 1)
        if additive is None:  # plain causal
            keep = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
            p = torch.where(keep, torch.exp(x), 0.0)
        else:  # the forward's 0 / -inf mask, (B or 1, 1, T, S) -> over the G query heads of a KV head
            p = torch.exp(x + additive.unsqueeze(2).float())
        d_out = d_out.contiguous()
        dg = d_out.reshape(B, KV, G * T, D)
        dv = p.to(q.dtype).view(B, KV, G * T, S).mT @ dg
        delta = (d_out.float() * out.float()).sum(-1)  # (B, H, T): rowsum(dO * O)
        da = torch.cat((d_out, _bf16_parts(-delta)), -1).reshape(B, KV, G * T, D + 2)
        va = torch.cat((v, torch.ones(B, KV, S, 2, dtype=v.dtype, device=v.device)), -1)
        dp_minus_delta = (da @ va.mT).view(B, KV, G, T, S)
        ds = (p * dp_minus_delta.float()).to(q.dtype).view(B, KV, G * T, S)
        dq = (ds @ k).view(B, H, T, D) * scale
        dk = (ds.mT @ qg) * scale
        return dq, dk, dv, None, None


def cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  attn_mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention for training on CPU (`_CpuAttention`): q (B, H, T, hd), k, v
    (B, KV, T, hd) bf16, H a multiple of KV; `attn_mask` None (plain causal) or (B or 1, 1,
    T, T), bool or additive float. Returns (B, H, T, hd) bf16, equal to
    F.scaled_dot_product_attention's forward; the gradients agree within bf16 rounding."""
    return _CpuAttention.apply(q, k, v, attn_mask, scale)


__all__ = ["CPU_ATTENTION", "CPU_ATTENTION_MAX_SCORES", "cpu_attention"]
