"""The recipe's training step as shipped, against the same step with a change taken back.

The speedrun recipe (`configs/stdlib-tiny.toml`: its model, Muon + AdamW, `train.compile`,
`precision = "auto"`, 16 x 256 packed rows with document masks) is built once per arm with
the same weights and the same batches (random tokens in documents of 200-8,000 tokens, so
micro-batches with and without a document boundary both occur, as in the stdlib corpus).
`Trainer.train_step` of every arm runs interleaved, round by round, in one process. The arms:

- as shipped;
- attention backward sdpa: compiled bf16 CPU training through torch's own flash backward
  (`lmforge.model.cpu_attention.CPU_ATTENTION = False`), as before 2026-11-26;
- Newton-Schulz written out: Muon's iteration as `a x + (b s + c s s) x` with separate bf16
  elementwise passes (the form before 2026-11-26; below as `newton_schulz_written_out`);
- before: both taken back (the recipe's step before 2026-11-26);
- two graphs: micro-batches whose rows hold one document each attend plain causal (the
  session-14 step; `one_segment_per_row` decides, a graph break and a second compiled graph)
  where the recipe now keeps the document mask (one graph, 2026-11-26).

Both changes keep the arithmetic's meaning; the last column shows the losses staying together.

Run: `python bench/bench_recipe_step.py [--warmup 4] [--repeat 16]`; `--smoke`: a tiny model,
eager, one timed round (proves the benchmark runs; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "stdlib-tiny.toml"


def newton_schulz_written_out(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Muon's quintic Newton-Schulz as lmforge wrote it before 2026-11-26 (Jordan et al. 2024's
    first form): each step's scaling and sums as separate passes in `dtype`."""
    from lmforge.train.optim import NS_COEFFS

    a, b, c = NS_COEFFS
    x = g.to(dtype)
    x = x / (x.float().norm(dim=(-2, -1), keepdim=True) + 1e-7).to(dtype)
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * (s @ s)) @ x
    return x


def document_stream(vocab: int, seq_len: int, batch: int, seed: int = 0, n_docs: int = 400):
    """A RowStream over random tokens in documents of 200-8,000 tokens (packed, masked)."""
    from lmforge.data.packing import RowStream

    rng = np.random.default_rng(seed)
    lengths = rng.integers(200, 8000, size=n_docs)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(5, vocab, size=int(offsets[-1]), dtype=np.int64)

    def get_tokens(s: int, start: int, stop: int) -> np.ndarray:
        return tokens[offsets[s] + start: offsets[s] + stop]

    return RowStream(lengths - 1, get_tokens, None, seq_len, batch, pad_id=0, seed=seed)


def recipe_config(smoke: bool):
    from lmforge.config import load_config

    cfg = load_config(RECIPE)
    t = replace(cfg.train, steps=10**6, time_budget_s=0, checkpoint_every=0, eval_every=0)
    if smoke:  # seconds: a tiny model, eager, fp32
        cfg = replace(cfg, model=replace(cfg.model, dim=64, n_layers=2, n_heads=4, n_kv_heads=2),
                      data=replace(cfg.data, seq_len=32))
        t = replace(t, micro_batch_size=2, compile=False, precision="fp32")
    return replace(cfg, train=t)


def build_trainer(cfg, workdir: Path):
    from lmforge.model import Transformer, resolve_model_config
    from lmforge.train.trainer import Trainer

    model = Transformer(resolve_model_config(cfg.model, common.synthetic_contract(cfg.tokenizer.vocab_size)))
    model.reset_parameters(seed=cfg.train.seed, zero_init=cfg.train.zero_init)
    stream = document_stream(cfg.tokenizer.vocab_size, cfg.data.seq_len, cfg.train.micro_batch_size)
    return Trainer(cfg, workdir / "run", workdir, model, stream, None, progress=False)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps per arm (the first compiles)")
    ap.add_argument("--repeat", type=int, default=16, help="timed steps per arm")
    common.smoke_flag(ap)
    args = ap.parse_args([] if argv is None else argv)
    if args.smoke:
        args.warmup, args.repeat = 1, 1
    from lmforge.model import attention, cpu_attention
    from lmforge.train import optim

    shipped, one_graph = optim.newton_schulz, attention._one_training_graph
    two_graphs = lambda *args: False  # noqa: E731
    arms = {"as shipped": (True, shipped, one_graph), "attention backward sdpa": (False, shipped, one_graph),
            "Newton-Schulz written out": (True, newton_schulz_written_out, one_graph),
            "before (both taken back)": (False, newton_schulz_written_out, one_graph),
            "two graphs (plain causal rows)": (True, shipped, two_graphs)}
    cfg = recipe_config(args.smoke)
    t_start = time.perf_counter()
    losses: dict[str, list[float]] = {n: [] for n in arms}
    with tempfile.TemporaryDirectory(prefix="lmforge-recipe-step-") as tmp:
        trainers = {n: build_trainer(cfg, Path(tmp) / f"arm{i}") for i, n in enumerate(arms)}

        def step(name: str):
            def run() -> None:
                cpu_attention.CPU_ATTENTION, optim.newton_schulz, attention._one_training_graph = arms[name]
                try:
                    losses[name].append(trainers[name].train_step()["loss"])
                finally:
                    cpu_attention.CPU_ATTENTION, optim.newton_schulz, attention._one_training_graph = (
                        True, shipped, one_graph)
            return run

        times = common.interleaved({n: step(n) for n in arms}, args.warmup, args.repeat)
        runtime = trainers["as shipped"].runtime
    base = times["as shipped"].median
    rows = [(n, f"{1e3 * times[n].median:,.1f}", common.Stats([1e3 * x for x in times[n].samples]).spread(),
             f"{times[n].median / base:.3f}x", f"{losses[n][0]:.4f} / {losses[n][-1]:.4f}") for n in arms]
    m = cfg.model
    precision = "bf16 autocast" if runtime.dtype is not None else "fp32"
    text = common.table(
        ["arm", "ms a step (median)", "min-max", "time vs as shipped", f"loss, step 1 / {args.warmup + args.repeat}"],
        rows, title="The recipe's training step, as shipped and with each change taken back"
                    + (" (SMOKE RUN: figures mean nothing)" if args.smoke else ""))
    text += (f"\n\n- the recipe's model (dim {m.dim}, {m.n_layers} layers, {m.n_heads}/{m.n_kv_heads} heads, vocab "
             f"{cfg.tokenizer.vocab_size}), {cfg.train.micro_batch_size} x {cfg.data.seq_len} rows, "
             f"{cfg.train.optimizer}, {precision}, torch.compile {'on' if cfg.train.compile else 'off'}; "
             f"{args.warmup} untimed + {args.repeat} timed steps an arm, interleaved (order reversed every "
             f"other round).")
    print(text, flush=True)
    return {"benchmark": "recipe_step", "smoke": args.smoke,
            "arms": {n: {"step_s": times[n].as_dict(), "losses": losses[n]} for n in arms},
            "seconds": round(time.perf_counter() - t_start, 1)}


if __name__ == "__main__":
    main(sys.argv[1:])
