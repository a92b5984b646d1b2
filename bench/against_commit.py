"""Decode speed of this tree against an earlier commit's, in one process, step by step.

The wall clock of two runs of `bench_decode.py` on a shared 2-core VM spreads +-20% between
runs, more than a 5% question can stand. This tool loads the other commit's `src/lmforge` into
this process as a second package (`lmforge_ref`: `git archive` of the commit, its imports
renamed), gives both models the same weights (bench_decode's model: dim 256, 4 layers, 8 query /
4 KV heads, vocab 8192, float32, one thread) and alternates them one decode step at a time
(the order swapped every step), so a noisy neighbour slows both alike. Reported:

- the fused decode step (`decode_step`, one shared cache slot), batch 1 and 8: the median and
  10th percentile of `--repeats` x `--steps` single-step times each, and their ratio, with the
  largest logit difference between the two trees;
- RL's rollouts: `generate` sampling 4 prompts x 8 completions, 96 new tokens, temperature 1,
  with log-probabilities (`bench_rl.py --speed`'s batch), the two trees alternating call by
  call: median tokens/s and the median of the paired time ratios, and whether the ids are equal.

    python bench/against_commit.py bbc778c [--steps 128] [--repeats 30] [--rounds 30]
    python bench/against_commit.py HEAD --smoke     # seconds: proves it runs

Not a `bench_*.py`: `make bench` has no commit to compare against. Figures go in bench/RESULTS.md
by hand, with the commit and the machine.
"""

from __future__ import annotations

import argparse
import importlib
import io
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import bench_decode  # noqa: E402
import common  # noqa: E402

IMPORT = re.compile(r"^(\s*)(from|import) lmforge(?=[.\s])", re.M)


def load_ref(commit: str, into: Path):
    """`commit`'s src/lmforge as the package `lmforge_ref` (imported from `into`)."""
    blob = subprocess.run(["git", "-C", str(common.ROOT), "archive", commit, "src/lmforge"],
                          capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    pkg = into / "lmforge_ref"
    (into / "src" / "lmforge").rename(pkg)
    for f in pkg.rglob("*.py"):
        text = IMPORT.sub(r"\1\2 lmforge_ref", f.read_text())
        f.write_text(re.sub(r"\blmforge\.(?=[a-z_]+[.\s])", "lmforge_ref.", text))
    sys.path.insert(0, str(into))
    return importlib.import_module("lmforge_ref")


def models(ref, smoke: bool):
    """(this tree's model, the commit's) with identical float32 weights, in eval mode."""
    from lmforge.config import ModelConfig
    from lmforge.model import Transformer
    shape = dict(bench_decode.SMOKE_SHAPE, vocab_size=bench_decode.SMOKE_VOCAB) if smoke else common.SHAPES["speedrun"]
    vocab = shape["vocab_size"]
    ours = Transformer(ModelConfig(**shape, max_seq_len=512))
    ours.reset_parameters(seed=0)
    theirs = importlib.import_module("lmforge_ref.model").Transformer(
        importlib.import_module("lmforge_ref.config").ModelConfig(**shape, max_seq_len=512))
    theirs.load_state_dict(ours.state_dict())
    return ours.eval(), theirs.eval(), vocab


def paired_steps(pair, batch: int, steps: int, repeats: int) -> dict:
    """Single decode steps of both models alternating (order swapped each step)."""
    times = {name: [] for name in pair}
    diff = 0.0
    tok = torch.full((batch,), 7)
    for r in range(repeats):
        caches = {name: mod.new_cache(model, batch, steps + 1) for name, (model, mod) in pair.items()}
        for i in range(steps):
            pos, out = torch.full((batch,), i), {}
            for name in (list(pair) if (i + r) % 2 == 0 else list(pair)[::-1]):
                model, mod = pair[name]
                t0 = time.perf_counter()
                out[name] = mod.decode_step(model, tok, pos, caches[name])
                times[name].append(time.perf_counter() - t0)
            diff = max(diff, (out["HEAD"] - out["commit"]).abs().max().item())
    return {"times": times, "max_logit_diff": diff}


def rollouts(gens: dict, contract, rounds: int, n_new: int) -> dict:
    """generate's sampling at bench_rl --speed's batch, the two trees alternating call by call."""
    prompts = [p for p in bench_decode.prompts_for(4, 0, contract) for _ in range(8)]

    def go(name, seed):
        model, generate, Sampling = gens[name]
        return generate(model, prompts, [], Sampling(max_new_tokens=n_new, temperature=1.0), contract.pad_id,
                        generator=torch.Generator().manual_seed(seed), return_logprobs=True)

    same = go("HEAD", 1)[0] == go("commit", 1)[0]
    seeds = iter(range(1 << 30))  # a new sampler seed a call; both trees draw the same ones, in turn
    stats = common.interleaved({name: lambda name=name: go(name, next(seeds) // 2) for name in gens}, 0, rounds)
    times = {name: st.samples for name, st in stats.items()}
    return {"times": times, "ids_equal": same, "tokens": len(prompts) * n_new}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("commit", help="the commit to compare against (anything `git archive` takes)")
    ap.add_argument("--steps", type=int, default=128, help="decode steps per repeat")
    ap.add_argument("--repeats", type=int, default=30, help="fresh caches per batch size")
    ap.add_argument("--rounds", type=int, default=30, help="rollout calls per tree")
    ap.add_argument("--threads", type=int, default=1)
    common.smoke_flag(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.repeats, args.rounds = 8, 2, 2
    torch.set_num_threads(args.threads)
    from lmforge.generate import SamplingConfig, generate
    from lmforge.model import decode
    with tempfile.TemporaryDirectory() as tmp:
        ref = load_ref(args.commit, Path(tmp))
        ours, theirs, vocab = models(ref, args.smoke)
        ref_decode = importlib.import_module("lmforge_ref.model.decode")
        ref_gen = importlib.import_module("lmforge_ref.generate")
        pair = {"commit": (theirs, ref_decode), "HEAD": (ours, decode)}
        rows, result = [], {"commit": args.commit, "machine": common.machine()}
        for batch in (1, 8):
            res = paired_steps(pair, batch, args.steps, args.repeats)
            t = res["times"]
            med = {n: statistics.median(v) for n, v in t.items()}
            p10 = {n: sorted(v)[len(v) // 10] for n, v in t.items()}
            result[f"step_b{batch}"] = {"median_ms": {n: v * 1e3 for n, v in med.items()},
                                        "p10_ms": {n: v * 1e3 for n, v in p10.items()},
                                        "max_logit_diff": res["max_logit_diff"]}
            rows.append([f"decode step, batch {batch} (ms, median / p10)",
                         f"{med['commit'] * 1e3:.3f} / {p10['commit'] * 1e3:.3f}",
                         f"{med['HEAD'] * 1e3:.3f} / {p10['HEAD'] * 1e3:.3f}",
                         f"{med['HEAD'] / med['commit'] - 1:+.1%} / {p10['HEAD'] / p10['commit'] - 1:+.1%}",
                         f"max |logit diff| {res['max_logit_diff']:.1e}"])
        contract = common.synthetic_contract(vocab)
        gens = {"commit": (theirs, ref_gen.generate, ref_gen.SamplingConfig),
                "HEAD": (ours, generate, SamplingConfig)}
        res = rollouts(gens, contract, args.rounds, 12 if args.smoke else 96)
        t = res["times"]
        rate = {n: res["tokens"] / statistics.median(v) for n, v in t.items()}
        paired = statistics.median(h / c for c, h in zip(t["commit"], t["HEAD"]))
        result["rollouts"] = {"tokens_per_s": rate, "paired_time_ratio": paired, "ids_equal": res["ids_equal"]}
        rows.append(["RL rollouts 4 x 8, 96 tokens, T=1 (tok/s, median)", f"{rate['commit']:,.0f}",
                     f"{rate['HEAD']:,.0f}", f"{paired - 1:+.1%} (paired time)", f"ids equal: {res['ids_equal']}"])
    print(common.machine_line(result["machine"]))
    print(common.table(["measure", args.commit, "HEAD", "HEAD's time", "check"], rows,
                       title=f"decode, this tree against {args.commit} (one process, alternating)"
                       + (" (SMOKE RUN: figures mean nothing)" if args.smoke else "")))
    return result


if __name__ == "__main__":
    main()
