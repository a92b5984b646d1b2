"""lmforge's Muon + AdamW: one optimizer, two update rules, state keyed per parameter.

Muon (Jordan et al. 2024, github.com/KellerJordan/Muon; the modded-nanogpt speedrun
records) updates each 2-D hidden matrix (attention and MLP projections) with Nesterov
momentum whose update is orthogonalised by a few quintic Newton-Schulz iterations;
embeddings, the output head and the norm weights stay on AdamW (Loshchilov & Hutter 2019).

Why not `torch.optim.Muon` (torch 2.13): it runs one Newton-Schulz chain per matrix, and
on this 2-core CPU that made a training step ~26% slower (docs/recipe.md). Here the
matrices of one shape (wide orientation: a tall matrix is transposed) are stacked and
orthogonalised in one batched bf16 chain (nanochat's `nanochat/optim.py` does the same on
GPU), so the 28 hidden matrices of the default model cost 3 batched chains.

The update size follows Moonlight (Liu et al. 2025, arXiv 2502.16982, torch's
`adjust_lr_fn="match_rms_adamw"`): the orthogonalised update is scaled by
0.2 * sqrt(max(rows, cols)), so Muon's matrices take the same learning rate as AdamW's.

Param groups carry `kind` ("muon" or "adamw") and `lr_scale`: the trainer sets one `lr`
for every group (the schedule) and each group steps with lr * lr_scale. Per-parameter
state is plain tensors (`momentum_buffer`; `step`, `exp_avg`, `exp_avg_sq`), so
`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` keys it by parameter
name like torch's AdamW and resume is bit-exact. Under FSDP2 a Muon matrix's gradient is a
DTensor shard: it is gathered (`full_tensor`), orthogonalised whole, and each rank keeps its
own shard of the update, so the result equals one process.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from lmforge.runtime import Runtime

#: quintic Newton-Schulz coefficients (Jordan et al. 2024): steep near 0, converge to ~[0.7, 1.2]
NS_COEFFS = (3.4445, -4.7750, 2.0315)
#: elements of AdamW's update computed at once on a CPU: its temporary stays 16 MB of float32
ADAM_SLICE = 1 << 22


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximately orthogonalise a batch of matrices `g` (B, m, n) with m <= n: returns
    ~U V^T of each matrix's SVD, (B, m, n) in `dtype` (Muon's zeroth power, Jordan et al. 2024).

    Each iteration is x <- a x + (b s + c s s) x with s = x x^T, written as two `baddbmm`s (as the
    Muon reference's later versions and nanochat write it): the scaling and the sum happen in the
    matrix product's float32 accumulator, one rounding to `dtype` each instead of four, and no
    separate elementwise passes (on a 2-core CPU in bf16: 0.65x the time of the written-out form,
    half its distance to a float64 iteration; bench/RESULTS.md, 2026-11-26)."""
    a, b, c = NS_COEFFS
    x = g.to(dtype)
    x = x / (x.float().norm(dim=(-2, -1), keepdim=True) + 1e-7).to(dtype)
    for _ in range(steps):
        s = torch.bmm(x, x.mT)
        x = torch.baddbmm(x, torch.baddbmm(s, s, s, beta=b, alpha=c), x, beta=a)
    return x


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the groups with kind="muon" (2-D parameters), AdamW for the rest.

    Group keys: lr, lr_scale, weight_decay, kind; muon groups: momentum, nesterov, ns_steps,
    ns_dtype ("bfloat16", or "float32" for an fp32 run: a CPU without bf16 units, and exact
    comparisons); adamw groups: betas, eps.
    """

    def __init__(self, groups: list[dict], lr: float = 3e-3):
        defaults = dict(lr=lr, lr_scale=1.0, weight_decay=0.0, kind="adamw", betas=(0.9, 0.95), eps=1e-8,
                        momentum=0.95, nesterov=True, ns_steps=5, ns_dtype="bfloat16")
        super().__init__(groups, defaults)
        for g in self.param_groups:
            if g["kind"] not in ("muon", "adamw"):
                raise ValueError(f"param group kind {g['kind']!r}: expected 'muon' or 'adamw'")
            if g["kind"] == "muon" and any(p.dim() != 2 for p in g["params"]):
                raise ValueError("Muon groups take 2-D parameters only")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon(group)
            else:
                self._adamw(group)
        return loss

    def _adamw(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        lr = group["lr"] * group["lr_scale"]
        b1, b2 = group["betas"]
        for p in params:
            st = self.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        grads = [p.grad for p in params]
        m = [s["exp_avg"] for s in states]
        v = [s["exp_avg_sq"] for s in states]
        for s in states:
            s["step"] += 1
        step = float(states[0]["step"])  # every parameter of a group steps together
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        torch._foreach_lerp_(m, grads, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
        bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
        if any(p.device.type != "cpu" or hasattr(p, "to_local") for p in params):
            # an accelerator's multi-tensor kernels (or FSDP2's shards): sqrt(v) of the group at once
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, math.sqrt(bc2))
            torch._foreach_add_(denom, group["eps"])
            torch._foreach_addcdiv_(params, m, denom, value=-lr / bc1)
            return
        # on a CPU (where foreach ops loop over the tensors anyway): the same ops slice by slice,
        # so the denominator is one slice (16 MB), not a copy of every parameter of the group
        for p, mi, vi in zip(params, m, v):
            pf, mf, vf = p.detach().view(-1), mi.view(-1), vi.view(-1)
            for i in range(0, pf.numel(), ADAM_SLICE):
                j = i + ADAM_SLICE
                denom = vf[i:j].sqrt().div_(math.sqrt(bc2)).add_(group["eps"])
                pf[i:j].addcdiv_(mf[i:j], denom, value=-lr / bc1)

    def _muon(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        lr = group["lr"] * group["lr_scale"]
        mom = group["momentum"]
        # momentum per parameter (the state the checkpoint holds), then the Nesterov update, as
        # foreach ops over the group (one kernel launch per op, not one per matrix)
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        grads = [p.grad for p in params]
        torch._foreach_lerp_(bufs, grads, 1 - mom)
        updates = torch._foreach_lerp(grads, bufs, mom) if group["nesterov"] else bufs
        by_shape: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        for p, u in zip(params, updates):
            u = u.full_tensor() if hasattr(u, "full_tensor") else u  # FSDP2: the whole matrix
            rows, cols = u.shape
            by_shape[(min(rows, cols), max(rows, cols))].append((p, u if rows <= cols else u.mT))
        if group["weight_decay"]:
            torch._foreach_mul_([_local(p) for p in params], 1 - lr * group["weight_decay"])
        for (rows, cols), items in by_shape.items():
            ortho = newton_schulz(torch.stack([u for _, u in items]), group["ns_steps"],
                                  getattr(torch, group["ns_dtype"])).to(items[0][0].dtype)  # one cast
            scale = 0.2 * math.sqrt(cols)  # Moonlight: match AdamW's update RMS
            targets, deltas = [], []
            for (p, u), o in zip(items, ortho.unbind(0)):
                o = o if p.shape[0] <= p.shape[1] else o.mT
                if hasattr(p, "device_mesh"):  # FSDP2: this rank's shard of the full update
                    from torch.distributed.tensor import distribute_tensor

                    # every rank computed the same full update: keep the local chunk, no collective
                    o = distribute_tensor(o.to(p.dtype).contiguous(), p.device_mesh, p.placements,
                                          src_data_rank=None)
                targets.append(_local(p))
                deltas.append(_local(o).to(p.dtype))  # a no-op but for mixed dtypes
            torch._foreach_add_(targets, deltas, alpha=-lr * scale)

#: The per-parameter state each update rule keeps (what a checkpoint's optimizer.pt must hold):
#: Muon its momentum; AdamW (this file's groups and torch.optim.AdamW alike) its step count and moments.
STATE_KEYS = {"muon": ("momentum_buffer",), "adamw": ("step", "exp_avg", "exp_avg_sq")}


def group_kind(group: dict) -> str:
    """"muon" or "adamw": the update rule of a param group (torch.optim.AdamW's groups have no
    `kind` and are "adamw")."""
    return str(group.get("kind", "adamw"))


def is_hidden_matrix(name: str, p: torch.nn.Parameter) -> bool:
    """The parameters Muon takes: 2-D matrices inside the blocks (not embeddings or the head),
    LoRA adapters excepted: their rank-r factors stay on AdamW (orthogonalising a rank x in
    factor is not the full matrix update Muon is made for; PEFT, torchtune and litgpt train
    adapters with AdamW)."""
    return p.dim() == 2 and name.startswith("layers.") and ".lora_" not in name


def decays(name: str, p: torch.nn.Parameter, optimizer: str) -> bool:
    """The one weight-decay rule: does parameter `name` take train.weight_decay?

    Never a vector (norm weights). With AdamW alone (train.optimizer = "adamw"), every matrix:
    the embedding, the blocks' projections and the head (nanoGPT's rule). With Muon ("muon"),
    the output head only: Muon's matrices and the embedding take none (best for short runs in
    the modded-nanogpt records).
    """
    if p.dim() < 2:
        return False
    return optimizer == "adamw" or name.startswith("output.")


def build_optimizer(model: torch.nn.Module, t, runtime: Runtime) -> torch.optim.Optimizer:
    """The optimizer of a training run, from a TrainConfig `t`: train.optimizer = "adamw",
    torch's AdamW (Loshchilov & Hutter 2019); "muon", `MuonAdamW` (see `build_muon_adamw`),
    whose Newton-Schulz runs in bf16 under a bf16 `runtime` and in float32 otherwise. Weight
    decay by `decays`."""
    if t.optimizer == "muon":
        return build_muon_adamw(model, t, "bfloat16" if runtime.dtype is not None else "float32")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if decays(n, p, "adamw")], "weight_decay": t.weight_decay},
              {"params": [p for n, p in named if not decays(n, p, "adamw")], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, foreach=True)


def build_muon_adamw(model: torch.nn.Module, t, ns_dtype: str = "bfloat16") -> MuonAdamW:
    """Groups for `model` from a TrainConfig `t`: Muon for the blocks' matrices, AdamW for the
    embedding (lr x embed_lr_scale), the head (lr x head_lr_scale) and the norms; weight decay
    by `decays` (the head only)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hidden = [(n, p) for n, p in named if is_hidden_matrix(n, p)]
    embed = [(n, p) for n, p in named if n.startswith("tok_embeddings.")]
    head = [(n, p) for n, p in named if n.startswith("output.")]
    taken = {id(p) for _, p in hidden + embed + head}
    rest = [(n, p) for n, p in named if id(p) not in taken]

    def group(params: list[tuple[str, torch.nn.Parameter]], **kw) -> dict:
        rule = {decays(n, p, "muon") for n, p in params}
        if len(rule) > 1:  # a new kind of parameter: give it a group of its own
            raise ValueError(f"param group {[n for n, _ in params]} mixes decayed and undecayed parameters")
        return dict(params=[p for _, p in params], weight_decay=t.weight_decay if rule == {True} else 0.0, **kw)

    adam = dict(kind="adamw", betas=(t.beta1, t.beta2), eps=1e-8)
    groups = [group(hidden, kind="muon", lr_scale=t.muon_lr_scale, momentum=t.muon_momentum, nesterov=True,
                    ns_steps=t.muon_ns_steps, ns_dtype=ns_dtype),
              group(embed, lr_scale=t.embed_lr_scale, **adam),
              group(head, lr_scale=t.head_lr_scale, **adam),
              group(rest, lr_scale=1.0, **adam)]
    return MuonAdamW([g for g in groups if g["params"]], lr=t.lr)


__all__ = ["MuonAdamW", "newton_schulz", "is_hidden_matrix", "decays", "build_optimizer", "build_muon_adamw",
           "NS_COEFFS", "STATE_KEYS", "group_kind"]
