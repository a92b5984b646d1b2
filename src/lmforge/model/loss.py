"""The one loss module of every stage (P3): the token cross-entropy (plain, and fused with the
output head: `linear_cross_entropy_sum`), the preference losses (`dpo_loss`,
`reference_free_loss`) and the policy gradient (`group_advantages`, `policy_gradient_loss` and
its denominator `policy_gradient_count`).

A training step's loss is a sum over *all* its micro-batches and data-parallel ranks divided by
a count over the same: for tokens, per-token cross-entropy (nats) over the supervised targets
divided by the number of those targets. Each function here gives one micro-batch's numerator;
the trainer counts the denominator first (all micro-batches, all-reduced over ranks), then runs
the backward passes. A micro-batch with no supervised target adds exactly 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmforge.config import DPO_LOSS_CHOICES, RL_LOSS_TYPES
from lmforge.runtime import compute_dtype
from lmforge.model.memory import LOSS_CHUNK_ROWS

#: The label of positions outside the loss mask, for F.cross_entropy (defined once, here).
IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy (nats) over supervised positions.

    Args:
        logits: (B, T, V) float (any dtype; computed in float32).
        targets: (B, T) int64.
        loss_mask: (B, T) bool; only True positions count (targets elsewhere are never read
            as labels, so a pad id equal to a real id cannot leak in, P4).
    Returns:
        0-dim float32 tensor (0.0 when nothing is supervised, never NaN).
    """
    V = logits.shape[-1]
    flat = logits.reshape(-1, V).float()
    # Unsupervised positions get IGNORE_INDEX as their label: the target id there (a pad, a
    # prompt token) is never read. Cheaper than selecting rows, which copies the logits.
    labels = torch.where(loss_mask.reshape(-1), targets.reshape(-1), IGNORE_INDEX)
    # reduction="sum" over zero supervised positions is exactly 0.0 (never NaN).
    return F.cross_entropy(flat, labels, reduction="sum", ignore_index=IGNORE_INDEX)


class _LinearCrossEntropySum(torch.autograd.Function):
    """sum over rows of CE(hidden @ weight.T, label), fused and chunked.

    Forward computes, chunk by chunk, the float32 logits, their log-sum-exp, the loss, and
    the gradient of the loss with respect to the logits (softmax - one-hot, zero for ignored
    rows). The full float32 logits and log-softmax are never materialised (the "Liger kernel"
    fused linear cross-entropy, Hsu et al. 2024, done in plain PyTorch).

    Ungrouped (one sum: every training step's loss), the loss is linear in its upstream scalar,
    so the forward also runs the backward's two matrix products chunk by chunk and keeps their
    results: d/dhidden (N, D) and, only when the weight takes a gradient, d/dweight (V, D), both
    float32; backward scales them. Nothing of size N x V outlives a chunk (for SmolLM2's 49,152
    tokens at 4 x 256 rows: 192 MB fewer), and a frozen head (LoRA) costs no weight product.
    Grouped (DPO's and RL's per-sequence sums, each group with its own upstream gradient), the
    gradient of the logits is kept (N, V) in the compute dtype and backward runs the products.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, compute_dtype, chunk_rows, groups=None, n_groups=0, softcap=0.0,
                temperature=1.0):
        h = hidden.to(compute_dtype)  # (N, D)
        w = weight.to(compute_dtype)  # (V, D)
        n = h.shape[0]
        # Eager, buffers are written chunk by chunk in place (1.2-1.4x faster than fresh tensors on a
        # 2-core CPU); traced by torch.compile, only out-of-place ops: torch 2.11 on CUDA dropped
        # the in-place writes into a saved buffer (every gradient 0, a frozen run; 2026-11-26 (an H100)),
        # and inductor fuses the out-of-place form as well (0.8-0.9x the in-place time here).
        traced = torch.compiler.is_compiling()
        # no gradient wanted (evaluation, a reference model): the loss only
        # (traced: the gradients always, as the compiled training step has been measured)
        want_h, want_w = ctx.needs_input_grad[0] or traced, ctx.needs_input_grad[1] or traced
        wants_grad = want_h or want_w
        grads = _Grads(n, w, compute_dtype, groups is not None, want_h, want_w, traced) if wants_grad else None
        total = torch.zeros(() if groups is None else (n_groups,), dtype=torch.float32, device=h.device)
        sums = [total]
        for s in range(0, n, chunk_rows):  # chunk_rows rows of float32 logits at a time stay in cache
            e = min(n, s + chunk_rows)
            ce, probs = _chunk_loss(torch.mm(h[s:e], w.t()).float(), labels[s:e], softcap, temperature,
                                    wants_grad, traced)
            if traced:
                sums.append(ce.sum() if groups is None else torch.zeros_like(total).index_add(0, groups[s:e], ce))
            elif groups is None:
                total += ce.sum()
            else:
                total.index_add_(0, groups[s:e], ce)
            if wants_grad:
                grads.add(s, e, probs, h, w)
            del probs  # freed before the next chunk's logits are made: one (rows, V) buffer at a time
        if traced:
            total = torch.stack(sums).sum(0)
        ctx.save_for_backward(h, w, *(grads.saved() if wants_grad else (None, None, None)), groups)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h, w, grad_logits, grad_h, grad_w, groups = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logits is None:  # ungrouped: the products were run in the forward; the upstream scalar scales them
            if want_w and not torch.compiler.is_compiling() and grad_w.dtype == ctx.dtypes[1]:
                grad_w = grad_w.mul_(grad_total)  # in place (autograd refuses a second backward: version moved)
            elif want_w:
                grad_w = (grad_w * grad_total).to(ctx.dtypes[1])
            return ((grad_h * grad_total).to(ctx.dtypes[0]) if want_h else None, grad_w if want_w else None,
                    None, None, None, None, None, None, None)
        # grouped: each row by its group's upstream gradient, then logits = h @ w.T gives the two products
        g = grad_logits * grad_total[groups][:, None].to(grad_logits.dtype)  # (N, V)
        grad_hidden = torch.mm(g, w).to(ctx.dtypes[0]) if want_h else None  # (N, V) @ (V, D) -> (N, D)
        grad_weight = torch.mm(g.t(), h).to(ctx.dtypes[1]) if want_w else None  # (V, N) @ (N, D) -> (V, D)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _chunk_loss(logits: torch.Tensor, lab: torch.Tensor, softcap: float, temperature: float, wants_grad: bool,
                traced: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk of `_LinearCrossEntropySum`: logits (rows, V) float32 (eager: reused as the
    gradient's buffer), labels (rows,) -> (CE (rows,) float32 with 0 on ignored rows,
    dCE/dlogits (rows, V) float32 or None when no gradient is wanted)."""
    chain = None  # the chain factor of dCE/dlogits from what is applied to the matmul's output
    if softcap:  # Gemma 2's final soft-cap: the loss is of c tanh(z / c), its gradient times 1 - tanh^2
        tanh = torch.tanh(logits / softcap)
        logits, chain = tanh * softcap, 1.0 - tanh * tanh
    if temperature != 1.0:  # the sampler's temperature (RL's log-probabilities): z / t, gradient / t
        logits = logits / temperature
        chain = 1.0 / temperature if chain is None else chain / temperature
    valid = lab != IGNORE_INDEX  # (rows,) bool: supervised rows
    safe = torch.where(valid, lab, 0)[:, None]  # (rows, 1): any in-range index for ignored rows
    lse = torch.logsumexp(logits, dim=-1)  # (rows,)
    ce = torch.where(valid, lse - logits.gather(1, safe).squeeze(1), 0.0)  # CE = logsumexp - label's logit
    if not wants_grad:
        return ce, None
    # dCE/dlogits = softmax - one_hot(label), zero on the ignored rows
    one_hot = -valid[:, None].to(torch.float32)  # (rows, 1)
    if traced:
        probs = torch.exp(logits - lse[:, None]).scatter_add(1, safe, one_hot) * valid[:, None]
        return ce, probs if chain is None else probs * chain
    probs = logits.sub_(lse[:, None]).exp_()  # in the logits buffer: softmax, then minus one at the label
    probs.scatter_add_(1, safe, one_hot)
    probs.mul_(valid[:, None])
    return ce, probs if chain is None else probs.mul_(chain)


class _Grads:
    """What `_LinearCrossEntropySum`'s forward keeps of each chunk's dCE/dlogits `probs` (rows, V)
    float32: grouped, the rows themselves in the compute dtype ((N, V), for backward's products);
    ungrouped, their products with the weight (d/dhidden, (N, D)) and with the hidden states
    (d/dweight summed over the chunks, (V, D)), float32, each only when wanted."""

    def __init__(self, n: int, w: torch.Tensor, dtype: torch.dtype, grouped: bool, want_h: bool, want_w: bool,
                 traced: bool):
        self.grouped, self.want_h, self.want_w, self.traced, self.dtype = grouped, want_h, want_w, traced, dtype
        self.V, self.D = w.shape
        self.device = w.device
        f32 = dict(dtype=torch.float32, device=w.device)
        self.parts: list[torch.Tensor] = []  # traced: the chunks' rows, joined at the end
        self.logits = None if traced or not grouped else torch.empty(n, self.V, dtype=dtype, device=w.device)
        self.gh = None if traced or grouped or not want_h else torch.empty(n, self.D, **f32)
        self.gw = torch.zeros(self.V, self.D, **f32) if not grouped and want_w else None

    def add(self, s: int, e: int, probs: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        g = probs.to(self.dtype)  # (rows, V): the products in the compute dtype, as the forward's
        if self.grouped:
            if self.traced:
                self.parts.append(g)
            else:
                self.logits[s:e] = g
            return
        if self.want_h:
            gh = torch.mm(g, w).float()  # (rows, D)
            if self.traced:
                self.parts.append(gh)
            else:
                self.gh[s:e] = gh
        if self.want_w:
            if self.traced:
                self.gw = self.gw + torch.mm(g.t(), h[s:e]).float()  # (V, D)
            else:
                self.gw.add_(torch.mm(g.t(), h[s:e]))

    def saved(self) -> tuple:
        """(dCE/dlogits (N, V) or None, d/dhidden (N, D) or None, d/dweight (V, D) or None)."""
        if not self.traced:
            return self.logits, self.gh, self.gw
        if self.grouped:
            joined = torch.cat(self.parts) if self.parts else torch.zeros(0, self.V, dtype=self.dtype, device=self.device)
            return joined, None, None
        joined = torch.cat(self.parts) if self.parts else torch.zeros(0, self.D, device=self.device)
        return None, joined, self.gw


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             loss_mask: torch.Tensor, chunk_rows: int = LOSS_CHUNK_ROWS,
                             groups: torch.Tensor | None = None, n_groups: int = 0,
                             softcap: float = 0.0, temperature: float = 1.0) -> torch.Tensor:
    """`cross_entropy_sum(hidden @ weight.T, targets, loss_mask)`, without materialising the
    float32 logits: the training and evaluation loss of lmforge's model.

    Args:
        hidden: (B, T, D) or (N, D) float, the final-norm hidden states.
        weight: (V, D) float, the output projection (V = the tokenizer's vocab).
        targets: (B, T) / (N,) int64; loss_mask: same shape, bool.
        chunk_rows: rows of logits computed at a time (float32 work stays in cache).
        groups: None, or (B, T) / (N,) int64 in [0, n_groups): sum each group's positions
            apart (a row, or one document of a packed row: DPO's sequence log-probabilities).
            Positions outside the loss mask add nothing to any group.
        softcap: c > 0: the logits are c * tanh(z / c) (the model's final_softcap); 0: z.
        temperature: the logits divided by it (after the soft-cap), as the sampler divides them.
    Returns:
        0-dim float32 tensor: summed nats over supervised positions (0.0 when none); with
        `groups`, (n_groups,) float32, one sum per group (0.0 for a group with none).
    Matmuls run in the autocast dtype when autocast is on (bf16 on CPU/GPU), else in
    hidden's dtype; the log-sum-exp and the loss are always float32.
    """
    D = hidden.shape[-1]
    h = hidden.reshape(-1, D)
    labels = torch.where(loss_mask.reshape(-1), targets.reshape(-1), IGNORE_INDEX)
    dtype = compute_dtype(h.device, torch.promote_types(h.dtype, weight.dtype))
    if groups is not None:
        groups = groups.reshape(-1).to(device=h.device, dtype=torch.int64)
    with torch.autocast(h.device.type, enabled=False):
        return _LinearCrossEntropySum.apply(h, weight, labels, dtype, chunk_rows, groups, n_groups, softcap,
                                            temperature)


#: The preference losses (`dpo.loss`, `config.DPO_LOSS_CHOICES`) that need no reference model
#: (`reference_free_loss`); the others compare with one (`dpo_loss`).
REFERENCE_FREE = ("simpo", "orpo")


def reference_free_loss(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, kind: str,
                        gamma: float = 0.5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A preference loss without a reference model, on length-normalised log-probabilities.

    Args:
        chosen, rejected: (N,) float32 mean log-probability per completion token (nats / token)
            of the model being trained.
        beta: SimPO's beta (the scale of the reward); ORPO's lambda (the weight of the odds-ratio
            term beside the SFT loss; Hong et al. use 0.1).
        kind: "simpo": -log sigmoid(beta (chosen - rejected) - gamma) (Meng et al. 2024, arXiv
            2405.14734, eq. 6; `gamma` the target reward margin); "orpo": -chosen + beta x
            -log sigmoid(log odds(chosen) - log odds(rejected)), odds(p) = e^p / (1 - e^p) (Hong et
            al. 2024, arXiv 2403.07691, eqs. 4-7: the SFT loss on the chosen reply plus the
            odds-ratio term).
    Returns:
        (losses (N,), chosen rewards (N,), rejected rewards (N,)), rewards = beta x the mean
        log-probability, detached (TRL's CPO/ORPO logging).
    """
    if kind == "simpo":  # a margin gamma in place of the reference's log-ratio
        losses = -F.logsigmoid(beta * (chosen - rejected) - gamma)
    elif kind == "orpo":  # the SFT loss on the chosen reply carries the odds-ratio term
        def log_odds(p: torch.Tensor) -> torch.Tensor:  # log(e^p / (1 - e^p)), p < 0
            return p - torch.log1p(-torch.exp(p.clamp(max=-1e-7)))  # clamped: p = 0 would give log 0
        losses = -chosen - beta * F.logsigmoid(log_odds(chosen) - log_odds(rejected))
    else:
        raise ValueError(f"reference-free loss {kind!r}: expected one of {REFERENCE_FREE}")
    return losses, beta * chosen.detach(), beta * rejected.detach()


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, kind: str = "sigmoid"
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The preference loss of each pair, and the implicit rewards.

    Args:
        policy_chosen, policy_rejected: (N,) float32 sequence log-probabilities (nats, summed
            over each completion) of the model being trained; ref_*: the same under the
            reference model (no gradient).
        beta: the strength of the pull towards the reference (DPO's beta; IPO's tau).
        kind: "sigmoid": -log sigmoid(beta * h) (Rafailov et al. 2023, arXiv 2305.18290,
            eq. 7); "ipo": (h - 1 / (2 beta))^2 (Azar et al. 2023, arXiv 2310.12036, eq. 17),
            with h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected).
    Returns:
        (losses (N,), chosen rewards (N,), rejected rewards (N,)), rewards = beta x
        (policy - reference) log-probability, detached. At policy == reference the sigmoid
        loss is ln 2 = 0.6931 for every pair.
    """
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)  # the log-ratios' margin
    if kind == "sigmoid":
        losses = -F.logsigmoid(beta * h)
    elif kind == "ipo":  # a squared target margin: h cannot grow without bound as under the sigmoid
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"dpo loss {kind!r}: expected one of {DPO_LOSS_CHOICES}")
    return losses, beta * (policy_chosen - ref_chosen).detach(), beta * (policy_rejected - ref_rejected).detach()


def token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) at `targets`: (R, T, V) float, (R, T) int64 (negative =
    none, read as 0) -> (R, T) float32 nats. The temperature is the sampler's (TRL PR #3029: a
    loss on another temperature than the one sampled differentiates another distribution)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """A_i = r_i - mean of its group (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783, eq. 3: no division
    by the group's spread, so a near-constant group never blows up, NeMo-RL #1518): (R,) float ->
    (R,) float64, groups of `group_size` consecutive rows. A group of equal rewards gets exactly 0.

    Raises:
        ValueError: a non-finite reward, a group size below 2, or R not a multiple of it.
    """
    r = rewards.double()
    if group_size < 2 or r.numel() % group_size:
        raise ValueError(f"group_size = {group_size} with {r.numel()} rewards: expected groups of >= 2 that divide them")
    if not bool(torch.isfinite(r).all()):
        raise ValueError(f"a reward is not finite ({r[~torch.isfinite(r)][0].item()}); rewards are numbers in [0, 1]")
    g = r.view(-1, group_size)
    return (g - g.mean(1, keepdim=True)).view(-1)


def policy_gradient_count(mask: torch.Tensor, loss_type: str, max_new_tokens: int) -> float:
    """What a micro-batch of R completions adds to the step's denominator of the policy gradient
    (`rl.loss_type`, one of `config.RL_LOSS_TYPES`): the one rule, read by `policy_gradient_loss`'s
    callers (the trainer sums it over micro-batches and ranks, P3).

    Args:
        mask: (R, T) bool, the completions' tokens (`policy_gradient_loss`'s mask).
        loss_type: "dr_grpo": R x max_new_tokens, a constant whatever the lengths (Dr. GRPO, Liu et
            al. 2025, arXiv 2503.20783: no length bias); "dapo": the completion tokens (DAPO, Yu et
            al. 2025, arXiv 2503.14476, its token-level loss); "grpo": R, each completion's terms
            already divided by its own length in the numerator (GRPO, Shao et al. 2024, arXiv
            2402.03300, eq. 3).

    Raises:
        ValueError: another loss_type.

    >>> mask = torch.tensor([[True, True, False], [True, False, False]])
    >>> [policy_gradient_count(mask, kind, max_new_tokens=3) for kind in ("dr_grpo", "dapo", "grpo")]
    [6.0, 3.0, 2.0]
    """
    if loss_type == "dr_grpo":
        return float(mask.shape[0] * max_new_tokens)
    if loss_type == "dapo":
        return float(int(mask.sum()))
    if loss_type == "grpo":
        return float(mask.shape[0])
    raise ValueError(f"loss_type {loss_type!r}: expected one of {RL_LOSS_TYPES}")


def policy_gradient_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, loss_type: str,
                         ref_logps: torch.Tensor | None = None, beta: float = 0.0) -> torch.Tensor:
    """The group-relative policy gradient's loss numerator over R completions; the trainer divides
    it by `policy_gradient_count` summed over micro-batches and ranks.

    Args:
        logps: (R, T) float32 log-probabilities of the sampled tokens under the model being trained
            (with grad; `token_logps` at the sampling temperature).
        advantages: (R,) float, `group_advantages` of the rewards.
        mask: (R, T) bool, the completion's tokens up to and including the sampled stop token
            (nanochat #810: a stop token outside the mask is never reinforced).
        loss_type: as `policy_gradient_count`; "grpo" divides each completion's terms by its own
            length here.
        ref_logps, beta: with beta > 0, beta x the k3 estimate of KL(policy || reference) per token,
            exp(ref - logp) - (ref - logp) - 1 (Schulman 2020; TRL's GRPOTrainer), in the same sum.
    Returns:
        A 0-dim float32 tensor, the sum over tokens of -A_i exp(logp - logp.detach()) (+ the KL
        term), with the "grpo" per-completion division. One optimizer step per batch of rollouts:
        the importance ratio is exactly 1 and its gradient is A grad log p.
    Raises:
        ValueError: another loss_type, or beta > 0 without ref_logps.
    """
    if loss_type not in RL_LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r}: expected one of {RL_LOSS_TYPES}")
    m = mask.to(logps.dtype)
    ratio = torch.exp(logps - logps.detach())  # 1 in value; its gradient is grad log p (on-policy)
    per_token = -advantages.to(logps.dtype)[:, None] * ratio
    if beta > 0:  # no reference model is built at beta = 0
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        d = ref_logps.to(logps.dtype) - logps
        per_token = per_token + beta * (torch.exp(d) - d - 1.0)  # k3: >= 0, unbiased, low variance
    per_row = (per_token * m).sum(1)  # the mask keeps prompts and padding out, the stop token in
    if loss_type == "grpo":  # each completion's mean over its own tokens (at least 1: no 0 / 0)
        per_row = per_row / m.sum(1).clamp(min=1.0)
    return per_row.sum()
