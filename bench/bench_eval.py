"""Evaluation suites side by side: `lmforge eval --tasks` on the speedrun's checkpoints.

For each checkpoint (default: a random-weight model of the speedrun's shape, the pretrained and
the SFT model; `--checkpoints name=DIR,...` adds DPO, RL or any other), the built-in suite
(`builtin`: mutants, docstrings, next_line, identifier; `--limit` items a task) and the
`functions` task (greedy pass@1, bodies run in the sandbox): per task the accuracy with its 95%
interval and the centred score, the suite's mean centred score, and the seconds the suite took.
The random model's intervals must cover the baselines (the scoring rules give chance exactly),
and a trained model's should sit above them.

`--speed`: the log-likelihood throughput of lmforge's scorer (`evals.scoring.loglikelihoods`)
beside the same requests through `transformers` on the `lmforge export` folder (a batched
forward of `LlamaForCausalLM`), and, where lm-eval is installed, lmforge's lm-eval adapter beside
lm-eval's own HFLM on the exported folder; interleaved rounds, fp32.

Run: `python bench/bench_eval.py [--limit 300] [--checkpoints dpo=runs/dpo,rl=runs/rl] [--speed]`.
Skipped (a note, exit 0) when the speedrun's checkpoints are absent: `make speedrun` writes them.
`--smoke`: a tiny model trained in seconds (figures mean nothing; proves the benchmark runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (puts src/ on the path)

import torch

from lmforge.errors import LmforgeError
from lmforge.evals.suite import results_table
from lmforge.stages.eval import eval_tasks_stage

DEFAULT = {"pretrain": common.ROOT / "runs" / "speedrun" / "pretrain",
           "sft": common.ROOT / "runs" / "speedrun" / "sft"}


def random_checkpoint(like: Path, out: Path) -> Path:
    """A checkpoint of `like`'s shape and tokenizer with freshly initialised weights."""
    from lmforge.loading import load_checkpoint
    from lmforge.train.checkpoint import save_checkpoint

    model, tok, cfg, path = load_checkpoint(like)
    model.reset_parameters(seed=0)
    return save_checkpoint(out, 0, model, cfg, path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=300, help="items a task")
    ap.add_argument("--checkpoints", default="", help="more checkpoints to score, name=DIR,...")
    ap.add_argument("--functions-limit", type=int, default=64, help="functions task: held-out functions")
    ap.add_argument("--speed", action="store_true", help="log-likelihood throughput against transformers instead")
    ap.add_argument("--rounds", type=int, default=3)
    common.smoke_flag(ap)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-eval-") as tmp:
        tmp = Path(tmp)
        if args.smoke:
            from bench_dpo import smoke_checkpoint

            ckpts = {"sft": smoke_checkpoint(tmp)}
            args.limit, args.functions_limit, args.rounds = 8, 4, 1
        else:
            missing = [str(p) for p in DEFAULT.values() if not p.exists()]
            if missing:
                print(f"bench_eval: skipped: no checkpoint at {', '.join(missing)} (`make speedrun` writes them)")
                return {"skipped": f"no checkpoint at {missing}"}
            ckpts = dict(DEFAULT)
        for spec in filter(None, args.checkpoints.split(",")):
            name, _, folder = spec.partition("=")
            ckpts[name] = Path(folder)
        if args.speed:
            return speed(ckpts["sft"], args, tmp)
        ckpts = {"random": random_checkpoint(ckpts["sft"], tmp / "random"), **ckpts}
        return suites(ckpts, args)


def suites(ckpts: dict[str, Path], args) -> dict:
    results = {}
    for name, path in ckpts.items():
        t0 = time.perf_counter()
        res = eval_tasks_stage(path, "builtin", args.limit, seed=0)
        seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            fn = eval_tasks_stage(path, "functions", args.functions_limit, seed=0)["tasks"]["functions"]
        except LmforgeError as exc:  # a smoke model's held-out set may hold no checkable function
            print(f"{name}: functions skipped: {exc}")
            fn = {"accuracy": 0.0, "n": 0, "interval": [0.0, 1.0]}
        res["functions"], res["seconds"], res["functions_seconds"] = fn, seconds, time.perf_counter() - t0
        results[name] = res
        print(f"### {name} ({path}): suite {res['suite']:+.3f} in {seconds:.1f} s; functions {fn['accuracy']:.1%} "
              f"of {fn['n']} in {res['functions_seconds']:.1f} s\n\n{results_table(res)}\n", flush=True)
    tasks = list(next(iter(results.values()))["tasks"])
    headers = ["checkpoint", *tasks, "suite (mean centred)", "functions pass@1", "suite s"]
    rows = []
    for name, res in results.items():
        cells = []
        for t in tasks:
            r = res["tasks"][t]
            cells.append(f"{r['accuracy']:.1%} [{r['interval'][0]:.0%}, {r['interval'][1]:.0%}]")
        fn = res["functions"]
        rows.append([name, *cells, f"{res['suite']:+.3f}",
                     f"{fn['accuracy']:.1%} of {fn['n']} [{fn['interval'][0]:.0%}, {fn['interval'][1]:.0%}]",
                     f"{res['seconds']:.0f}"])
    base = next(iter(results.values()))["tasks"]
    rows.append(["random baseline", *[f"{base[t]['baseline']:.1%}" for t in tasks], "0", "0", ""])
    print(common.table(headers, rows, title=f"lmforge eval --tasks builtin (limit {args.limit}) and functions; "
                                            f"accuracy [95% interval]; {common.machine_line()}"
                                            + (" (SMOKE RUN: figures mean nothing)" if args.smoke else "")))
    return {"limit": args.limit, "results": results, "machine": common.machine_line()}


def speed(ckpt: Path, args, tmp: Path) -> dict:
    """Requests/s of lmforge's scorer and of transformers on the exported folder (module docstring)."""
    import transformers

    from lmforge.evals.builtin import builtin_tasks
    from lmforge.evals.scoring import encode_pair, loglikelihoods
    from lmforge.export import export_hf
    from lmforge.loading import load_checkpoint

    model, tok, cfg, _ = load_checkpoint(ckpt)
    model = model.float().eval()
    tasks = builtin_tasks(["next_line", "identifier"], cfg.data.val_fraction, cfg.data.include_tests, 0,
                          max(args.limit // 2, 4), tok=tok)
    def lm_eval_pair(ctx: str, cont: str) -> bool:
        """lm-eval's own encoding of the pair leaves a continuation token (`TemplateLM._encode_pair`: the
        context's trailing spaces moved, then the joint encoding cut at the context's length; HFLM asserts)."""
        n = len(ctx) - len(ctx.rstrip())
        ctx, cont = (ctx[:-n], ctx[-n:] + cont) if n else (ctx, cont)
        return len(tok.encode(ctx + cont)) > len(tok.encode(ctx))

    requests = [r for t in tasks for x in t.items for r in t.requests(x) if lm_eval_pair(*r)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(export_hf(ckpt, tmp / "hf")),
                                                           dtype=torch.float32).eval()
    encoded = [encode_pair(tok, c, x) for c, x in requests]

    @torch.no_grad()
    def reference() -> list[float]:
        """The same requests through transformers: batches of 16 sorted by length, right padding."""
        out = [0.0] * len(encoded)
        order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i][0]))
        for b in range(0, len(order), 16):
            chunk = order[b: b + 16]
            T = len(encoded[chunk[0]][0])
            x = torch.full((len(chunk), T), tok.pad_id)
            mask = torch.zeros((len(chunk), T), dtype=torch.long)
            for r, i in enumerate(chunk):
                ids = encoded[i][0]
                x[r, : len(ids)], mask[r, : len(ids)] = torch.tensor(ids), 1
            logp = torch.log_softmax(hf(input_ids=x, attention_mask=mask).logits.float(), -1)
            for r, i in enumerate(chunk):
                ids, split = encoded[i]
                tgt = x[r, split: len(ids)]
                out[i] = float(logp[r, split - 1: len(ids) - 1].gather(-1, tgt[:, None]).sum())
        return out

    arms = {"lmforge (evals.scoring)": lambda: [x.logprob for x in loglikelihoods(model, tok, requests)],
            "transformers on the export": reference}
    try:  # lm-eval's own HFLM beside lmforge's adapter, when lm-eval is installed (make eval-interop)
        from lm_eval.api.instance import Instance
        from lm_eval.models.huggingface import HFLM

        from lmforge.evals.harness import register

        inst = [Instance(request_type="loglikelihood", doc={}, arguments=r, idx=i) for i, r in enumerate(requests)]
        adapter = register()(checkpoint=str(ckpt), batch_size=16, device="cpu")
        hflm = HFLM(pretrained=str(tmp / "hf"), dtype="float32", batch_size=16, device="cpu")
        arms["lm-eval: lmforge adapter"] = lambda: [x[0] for x in adapter.loglikelihood(inst, disable_tqdm=True)]
        arms["lm-eval: HFLM on the export"] = lambda: [x[0] for x in hflm.loglikelihood(inst, disable_tqdm=True)]
    except ImportError:
        print("bench_eval: lm-eval not installed: its HFLM and the adapter are left out (make eval-interop)")
    rates: dict[str, list[float]] = {k: [] for k in arms}
    got: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            got[name] = fn()
            rates[name].append(len(requests) / (time.perf_counter() - t0))
    def gap(a: str, b: str) -> float:
        return max(abs(x - y) for x, y in zip(got[a], got[b])) if a in got and b in got else float("nan")

    # lm-eval encodes a pair its own way (no document start before the context): compared within each pair
    diff = max(gap("lmforge (evals.scoring)", "transformers on the export"),
               gap("lm-eval: lmforge adapter", "lm-eval: HFLM on the export") if "lm-eval: HFLM on the export" in got
               else 0.0)
    med = {k: statistics.median(v) for k, v in rates.items()}
    rows = [[k, f"{med[k]:,.1f}", f"{min(v):,.1f}-{max(v):,.1f}"] for k, v in rates.items()]
    rows.append(["ratio lmforge / transformers", f"{med['lmforge (evals.scoring)'] / med['transformers on the export']:.2f}x", ""])
    if "lm-eval: HFLM on the export" in med:
        rows.append(["ratio adapter / HFLM", f"{med['lm-eval: lmforge adapter'] / med['lm-eval: HFLM on the export']:.2f}x",
                     ""])
    print(common.table(["scorer", "requests/s (median)", "min-max"], rows,
                       title=f"log-likelihood throughput, {len(requests)} requests (next_line + identifier), fp32, "
                             f"{args.rounds} rounds interleaved; max |difference| within a pair {diff:.1e} nats; "
                             f"{common.machine_line()}"))
    return {"requests_per_s": med, "max_abs_diff": diff}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), default=str)[:2000])
