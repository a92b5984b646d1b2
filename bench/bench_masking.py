"""Document masking: the step-time cost of attending within documents vs plain causal attention.

At the speedrun config (configs/stdlib-tiny.toml: dim 256, 4 layers, 8/4 heads, vocab 8192,
micro-batch 16 x seq 256, bf16 autocast where the CPU has bf16 units), one full training
step — `Trainer.train_step`: draw the micro-batch from a RowStream, forward, loss,
backward, gradient clipping, AdamW — exactly what `lmforge pretrain` runs, with
`model.attention = "sdpa"` (what "auto" picks on CPU). Two variants over the same packed
rows (documents of 25-250 tokens, so every row holds several and every step of the masked
variant takes the block-diagonal mask path: the worst case), interleaved round by round
in one process so a noisy neighbour slows both alike:

- plain causal: `data.document_masking = false` (one segment per row, running positions:
  sdpa `is_causal`);
- document masking: `data.document_masking = true` (per-document segments and positions).

Both see identical tokens, targets and loss masks, so the difference is the attention mask.
On the stdlib corpus most rows are one piece of a long document, and a micro-batch whose
rows are all one segment takes the `is_causal` path even with masking on; the bench counts
the share of such batches over an epoch (document lengths: the stdlib train split's UTF-8
bytes / 3.76 bytes per token, measured for the speedrun's 8192-token tokenizer, or the exact
lengths of a prepared data folder with `--data DIR`) and gives the expected stdlib cost:
that share x the worst-case overhead. Token values are random (they do not change timing).

A second table times one attention call alone (forward + backward at the layer's shapes):
causal, bool mask and additive mask, the mask built inside each call.

Where a CUDA GPU is at hand it also times flex (compiled FlexAttention, BlockMask) against
sdpa with the block-diagonal mask and sdpa causal, at seq_len 2048.

Run: `python bench/bench_masking.py [--repeat N] [--budget 45] [--threads N] [--data DIR]`.
It runs single-threaded by default (`--threads 0`: torch's default): on a CPU shared with
other jobs, two threads per op spend most of their time waiting on each other, and the
masking cost (the same kernels either way) drowns in that noise. About 55 s on 2 cores.
`--smoke`: a tiny model, micro-batch 2 x 32, one round: seconds (proves the benchmark runs).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

RECIPE = common.ROOT / "configs" / "stdlib-tiny.toml"
VOCAB = 8192
BYTES_PER_TOKEN = 3.76  # stdlib train split with the speedrun's 8192-token BPE (12.34 MB -> 3.28 M tokens)
GOAL = 1.05  # masking may cost at most 5% of a step
BASE = "plain causal (document_masking=false)"
MASKED = "document masking"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- data -----------------------------------------------------------------------------------
def stdlib_lengths(data_dir: str | None) -> tuple[np.ndarray, str]:
    """Document lengths in tokens ([bos] text [eos]) and where they came from."""
    if data_dir:
        offsets = np.fromfile(Path(data_dir) / "train.idx", dtype=np.int64)
        return np.diff(offsets), f"{data_dir}/train.idx"
    texts = common.stdlib_texts("train")
    lengths = np.array([max(1, round(len(t.encode("utf-8")) / BYTES_PER_TOKEN)) + 2 for t in texts])
    return lengths, f"stdlib train split, bytes / {BYTES_PER_TOKEN}"


def short_lengths(n: int = 4000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(25, 250, n)


def make_stream(lengths: np.ndarray, cfg, masking: bool, seed: int = 0):
    """A RowStream over random tokens with documents of `lengths` (each its own flat slice)."""
    from lmforge.data.packing import RowStream

    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat = np.random.default_rng(seed).integers(4, VOCAB, offsets[-1], dtype=np.int64)

    def get_tokens(s: int, start: int, stop: int) -> np.ndarray:
        return flat[offsets[s] + start: offsets[s] + stop]

    return RowStream(lengths - 1, get_tokens, None, cfg.data.seq_len, cfg.train.micro_batch_size, pad_id=0,
                     seed=seed, document_masking=masking)


def masked_share(stream, first: int, n_batches: int) -> float:
    """Fraction of the stream's micro-batches first..first+n_batches-1 (counted from the start
    of epoch 0) that take the masked path: some row holds more than one segment."""
    rows = stream.plan(0)
    B = stream.micro_batch_size
    masked = 0
    for i in range(first, first + n_batches):
        masked += any(len(rows[(i * B + j) % len(rows)]) > 1 for j in range(B))
    return masked / max(1, n_batches)


# -- the step --------------------------------------------------------------------------------
def speedrun_config(args):
    from lmforge.config import load_config

    sets = [f"model.vocab_size={VOCAB}", "model.attention=\"sdpa\"", "train.steps=1000000",
            f"train.micro_batch_size={args.batch}", f"data.seq_len={args.seq_len}", "train.precision=\"auto\"",
            "train.compile=false"]  # the eager step: what the masking itself costs
    if args.smoke:
        sets += ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2"]
    return load_config(RECIPE, sets)


def build_trainer(cfg, stream, workdir: Path):
    from lmforge.model import Transformer
    from lmforge.train.trainer import Trainer

    torch.manual_seed(0)
    model = Transformer(cfg.model)
    model.reset_parameters(seed=0)
    model.set_attention("sdpa")
    return Trainer(cfg, workdir / "run", workdir, model, stream, progress=False, log=lambda m: None)


def step_times(cfg, stdlib: np.ndarray, args) -> tuple[dict, dict]:
    """Interleaved step times of the three variants; returns (Stats per variant, info)."""
    from lmforge.runtime import resolve_precision

    streams = {
        BASE: make_stream(short_lengths(), cfg, masking=False),
        MASKED: make_stream(short_lengths(), cfg, masking=True),
    }
    info = {}
    for name, s in streams.items():
        info[name] = {"rows": len(s.plan(0)), "padding": s.padding_fractions[0]}
    real = make_stream(stdlib, cfg, masking=True)
    n_batches = len(real.plan(0)) // real.micro_batch_size
    info["stdlib"] = {"rows": len(real.plan(0)), "padding": real.padding_fractions[0], "batches": n_batches,
                      "masked_share": masked_share(real, 0, n_batches)}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {name: build_trainer(cfg, s, Path(tmp) / str(i)) for i, (name, s) in enumerate(streams.items())}
        fns = {name: t.train_step for name, t in trainers.items()}
        t0 = time.perf_counter()
        for _ in range(max(1, args.warmup)):
            for fn in fns.values():
                fn()
        per_round = (time.perf_counter() - t0) / max(1, args.warmup)
        repeat = args.repeat or int(min(15, max(3, (args.budget - (time.perf_counter() - args.t_start)) / per_round)))
        log(f"  warm-up: {per_round:.1f} s per round of {len(fns)} steps; timing {repeat} rounds")
        stats = common.interleaved(fns, 0, repeat)
        for name, s in streams.items():  # of the batches that were timed (every row is one piece
            # of a document or several; padding counts as a segment, so a padded row is masked)
            info[name]["masked_share"] = masked_share(s, max(1, args.warmup), repeat) if s.document_masking else 0.0
        precision = resolve_precision(cfg.train.precision, torch.device("cpu"))
    info["_"] = {"repeat": repeat, "precision": "bf16 autocast" if precision else "fp32"}
    return stats, info


# -- attention alone -------------------------------------------------------------------------------
def attention_times(cfg, repeat: int) -> dict:
    """One attention call at the layer's shapes, forward + backward, bf16 if the step uses it."""
    import torch.nn.functional as F

    from lmforge.model.attention import additive_document_mask, document_mask
    from lmforge.runtime import resolve_precision

    m = cfg.model
    B, T, H, KV, hd = cfg.train.micro_batch_size, cfg.data.seq_len, m.n_heads, m.n_kv_heads, m.dim // m.n_heads
    dtype = resolve_precision(cfg.train.precision, torch.device("cpu")) or torch.float32
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, hd, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(B, KV, T, hd, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(B, KV, T, hd, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(B, H, T, hd, generator=gen).to(dtype)
    docs = torch.sort(torch.randint(0, 4, (B, T), generator=gen), dim=1).values.int()

    def run(kind):
        def fn():
            if kind == "causal":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            elif kind == "bool mask":
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(docs), enable_gqa=True)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_document_mask(docs, dtype),
                                                   enable_gqa=True)
            y.backward(grad)
        return fn

    return common.interleaved({k_: run(k_) for k_ in ("causal", "bool mask", "additive mask")}, 2, repeat)


# -- CUDA: flex vs sdpa at seq_len 2048 ----------------------------------------------------------------
def cuda_flex_vs_sdpa(args) -> dict | None:
    if not torch.cuda.is_available():
        return None
    from lmforge.config import ModelConfig
    from lmforge.model import Transformer
    from lmforge.model.loss import cross_entropy_sum

    T, B = 2048, args.cuda_batch
    cfg = ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=VOCAB, max_seq_len=T)
    torch.manual_seed(0)
    model = Transformer(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    lengths = short_lengths(4000, seed=1) * 4  # ~100-1000 tokens: several documents per 2048-row
    from lmforge.config import Config

    c = Config()
    c.data.seq_len, c.train.micro_batch_size = T, B
    stream = make_stream(lengths, c, masking=True)
    batches = [stream.next_batch().to("cuda") for _ in range(4)]
    state = {"i": 0}

    def step(backend: str, causal: bool):
        def fn():
            b = batches[state["i"] % len(batches)]
            state["i"] += 1
            model.set_attention(backend)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if causal:
                    logits = model(b.tokens)
                else:
                    logits = model(b.tokens, b.positions, b.document_ids)
            loss = cross_entropy_sum(logits, b.targets, b.loss_mask) / b.n_supervised
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        return fn

    fns = {"sdpa causal": step("sdpa", True), "sdpa + document mask": step("sdpa", False),
           "flex + BlockMask (compiled)": step("flex", False)}
    stats = common.interleaved(fns, 3, args.repeat or 10)
    return {"stats": stats, "batch": B, "seq_len": T, "device": torch.cuda.get_device_name(0)}


# -- main ---------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per variant")
    ap.add_argument("--repeat", type=int, default=0, help="timed steps per variant (0: as many as --budget allows, 3-15)")
    ap.add_argument("--budget", type=float, default=45.0, help="seconds for the whole CPU part (guides --repeat 0)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (0: torch's default). 1 by default: on a CPU shared with other jobs, "
                         "several threads per op mostly wait on each other and the timings turn to noise")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--data", default=None, help="a prepared data folder: use its exact document lengths")
    ap.add_argument("--cuda-batch", type=int, default=8, help="micro-batch of the CUDA seq_len 2048 comparison")
    common.smoke_flag(ap)
    args = ap.parse_args([] if argv is None else argv)
    if args.smoke:
        args.warmup, args.repeat, args.batch, args.seq_len, args.cuda_batch = 1, 1, 2, 32, 1
    args.t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = speedrun_config(args)
    stdlib, source = stdlib_lengths(args.data)
    stats, info = step_times(cfg, stdlib, args)
    attn = attention_times(cfg, 1 if args.smoke else max(5, 2 * info["_"]["repeat"]))
    base = stats[BASE]
    masked = stats[MASKED]
    ratio = masked.median / base.median
    per_round = [a / b for a, b in zip(masked.samples, base.samples)]
    share = info["stdlib"]["masked_share"]
    expected = 1 + share * (ratio - 1)

    def verdict(r: float) -> str:
        return f"{r:.3f}" + (" ok" if r <= GOAL else f" (goal <= {GOAL})")

    rows = [(BASE, f"{1e3 * base.median:,.0f}", f"{1e3 * base.min:,.0f}-{1e3 * base.max:,.0f}", "1.000", "-"),
            (MASKED, f"{1e3 * masked.median:,.0f}", f"{1e3 * masked.min:,.0f}-{1e3 * masked.max:,.0f}",
             verdict(ratio), f"{min(per_round):.3f}-{max(per_round):.3f}")]
    m = cfg.model
    title = (f"Training step, document masking vs plain causal (dim {m.dim}, {m.n_layers} layers, "
             f"{m.n_heads}/{m.n_kv_heads} heads, vocab {VOCAB}, micro-batch {cfg.train.micro_batch_size} x "
             f"{cfg.data.seq_len}, {info['_']['precision']}, sdpa; every row several documents)"
             + (" (SMOKE RUN: figures mean nothing)" if args.smoke else ""))
    table = common.table(["variant", "step ms (median)", "min-max", "ratio of medians", "per-round ratios"],
                         rows, title=title)
    a_base = attn["causal"].median
    a_rows = [(n, f"{1e3 * s.median:,.1f}", f"{1e3 * s.min:,.1f}-{1e3 * s.max:,.1f}", f"{s.median / a_base:.2f}")
              for n, s in attn.items()]
    a_table = common.table(["attention call (fwd+bwd, mask built inside)", "ms (median)", "min-max", "ratio"],
                           a_rows, title="One attention call alone (a step runs one per layer)")
    st = info["stdlib"]
    notes = [
        f"{common.machine_line()}.",
        f"medians over {info['_']['repeat']} interleaved rounds after {args.warmup} warm-up round(s); "
        f"'per-round ratios': each round's masked step over that round's plain-causal step.",
        f"stdlib corpus ({source}): {st['rows']:,} rows an epoch, padding {100 * st['padding']:.2f}%; "
        f"{100 * share:.0f}% of its {st['batches']:,} micro-batches hold a row of several segments (the "
        f"rest run sdpa is_causal with masking on): expected stdlib step ratio {verdict(expected)}.",
        f"short-document rows: padding {100 * info[MASKED]['padding']:.2f}% (the same rows in both variants).",
    ]
    text = table + "\n\n" + a_table + "\n\n" + "\n".join(f"- {n}" for n in notes)
    results = {"benchmark": "masking", "machine": common.machine(), "goal_ratio": GOAL,
               "plain_causal_step_s": base.as_dict(), "masked_step_s": masked.as_dict(), "ratio": ratio,
               "round_ratio_min": min(per_round), "round_ratio_max": max(per_round),
               "stdlib_masked_batch_share": share, "stdlib_expected_ratio": expected,
               "stdlib_padding": st["padding"], "short_docs_padding": info[MASKED]["padding"],
               "attention_call_s": {n: s.as_dict() for n, s in attn.items()}}

    cuda = cuda_flex_vs_sdpa(args)
    if cuda is not None:
        c_base = cuda["stats"]["sdpa causal"].median
        c_rows = [(n, f"{1e3 * s.median:,.2f}", f"{1e3 * s.min:,.2f}-{1e3 * s.max:,.2f}", f"{s.median / c_base:.2f}")
                  for n, s in cuda["stats"].items()]
        text += "\n\n" + common.table(["variant", "step ms (median)", "min-max", "ratio"], c_rows,
                                      title=f"CUDA ({cuda['device']}): flex vs sdpa-masked, micro-batch "
                                            f"{cuda['batch']} x {cuda['seq_len']}, bf16")
        results["cuda"] = {n: s.as_dict() for n, s in cuda["stats"].items()} | {
            "batch": cuda["batch"], "seq_len": cuda["seq_len"], "device": cuda["device"]}
    else:
        text += "\n- no CUDA GPU here: the flex vs sdpa-masked comparison at seq_len 2048 was skipped."
        results["cuda"] = None
    print(text, flush=True)
    results["repeat"] = info["_"]["repeat"]
    results["seconds"] = round(time.perf_counter() - args.t_start, 1)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
