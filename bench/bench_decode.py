"""Decode throughput: lmforge `generate` against `transformers`' `generate`, same weights, this CPU.

A speedrun-sized model (dim 256, 4 layers, 8 query / 4 KV heads, vocab 8192, random
weights, lmforge's default options: QK-norm) is built in lmforge and turned into the
`transformers` model `lmforge export` would write (`common.hf_twin`: the exporter's own
`hf_config` and `to_hf_state`, so a Qwen3ForCausalLM for a QK-norm model, else a
LlamaForCausalLM); `--shape gemma3-270m` goes the other way, as a user's model does: transformers
saves a Gemma3ForCausalLM of random weights, `lmforge import-hf` imports it (`common.imported_model`).
Both generate greedily a fixed number of new tokens (stopping disabled) from the same prompts,
batch 1 and batch 8. Reported: median new tokens per second over a few repeats (prefill
included), the ratio, and whether both produced the same ids. transformers is a library that
raises rather than crashes: it runs in this process.

    python bench/bench_decode.py [--new-tokens 64] [--repeats 3] [--threads 1] [--shape smollm2-135m|gemma3-270m]
    python bench/bench_decode.py --smoke     # seconds, a tiny model: proves it runs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import common  # noqa: E402
from lmforge.config import ModelConfig  # noqa: E402
from lmforge.export import require_transformers  # noqa: E402
from lmforge.generate import SamplingConfig, generate  # noqa: E402
from lmforge.model import Transformer  # noqa: E402

SMOKE_VOCAB = 512
SMOKE_SHAPE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2)


def build_models(seed: int = 0, max_seq_len: int = 512, smoke: bool = False, shape: str = "speedrun",
                 work: Path | None = None):
    """(lmforge model, its transformers twin, contract) with identical float32 weights, of
    `common.SHAPES[shape]`; for an imported shape (`common.IMPORTED_SHAPES`) the user's transformers
    folder, saved into `work`, and lmforge's import of it (its own weights and max_seq_len: `seed` and
    `max_seq_len` are for the shapes built here)."""
    if shape in common.IMPORTED_SHAPES:
        transformers = require_transformers()
        _, ours, tok, folder = common.imported_model(work, smoke, shape)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        return ours.float().eval(), theirs.eval(), tok.contract
    dims = dict(SMOKE_SHAPE, vocab_size=SMOKE_VOCAB) if smoke else common.SHAPES[shape]
    vocab = dims["vocab_size"]
    cfg = ModelConfig(**dims, max_seq_len=max_seq_len)
    ours = Transformer(cfg)
    ours.reset_parameters(seed=seed)
    contract = common.synthetic_contract(vocab)
    return ours.eval(), common.hf_twin(ours, contract), contract


def prompts_for(batch: int, seed: int, contract) -> list[list[int]]:
    """`batch` prompts of 16..32 tokens (different lengths: left padding is exercised)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [32 - (i * 5) % 17 for i in range(batch)]
    first = max(i for i in contract.special_tokens.values() if i is not None) + 1
    return [[contract.bos_id, *torch.randint(first, contract.vocab_size, (n - 1,), generator=g).tolist()]
            for n in lengths]


def run_lmforge(model, prompts, n_new: int, contract, compile: bool = False) -> list[list[int]]:
    return generate(model, prompts, [], SamplingConfig(max_new_tokens=n_new, greedy=True, compile=compile),
                    contract.pad_id)


def run_hf(model, prompts, n_new: int, contract) -> list[list[int]]:
    transformers = require_transformers()
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[contract.pad_id] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    gc = transformers.GenerationConfig(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                       eos_token_id=None, pad_token_id=contract.pad_id,
                                       bos_token_id=contract.bos_id)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
    return out[:, L:].tolist()


def timed_pair(fa, fb, repeats: int) -> tuple[dict, dict, list, list]:
    """Run `fa` and `fb` alternately (one warm-up each, then `repeats` times) so load changes on a
    shared machine hit both alike. Returns per function {"wall": median s, "cpu": median
    process CPU s} and the last results."""
    fa(), fb()  # warm-up
    times: dict = {"a": {"wall": [], "cpu": []}, "b": {"wall": [], "cpu": []}}
    ra = rb = None
    for _ in range(repeats):
        for key, fn in (("a", fa), ("b", fb)):
            w, c = time.perf_counter(), time.process_time()
            r = fn()
            times[key]["wall"].append(time.perf_counter() - w)
            times[key]["cpu"].append(time.process_time() - c)
            if key == "a":
                ra = r
            else:
                rb = r
    med = {k: {m: statistics.median(v) for m, v in t.items()} for k, t in times.items()}
    return med["a"], med["b"], ra, rb


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the table, return {"batch_1": {...}, "batch_8": {...}, ...}.

    Each batch entry: lmforge_tok_s, transformers_tok_s (wall clock), ratio (wall),
    cpu_ratio (process CPU time: steadier on a shared machine), same_ids.
    """
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--compile", action="store_true",
                    help="also time lmforge with generate.compile = true (the decode step through torch.compile; "
                         "its one-time compile is left out: it runs in the warm-up)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for both (default 1: several threads on a busy 2-core "
                         "machine spend most of their time waiting for each other)")
    common.shape_flag(ap)
    common.smoke_flag(ap)
    args = ap.parse_args([] if argv is None else argv)
    if args.smoke:
        args.new_tokens, args.repeats, args.batches = 8, 1, [1, 3]
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads_before)  # run_all.py runs other benchmarks in this process


def _run(args) -> dict:
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        ours, theirs, contract = build_models(smoke=args.smoke, shape=args.shape, work=Path(work))
    results: dict = {"threads": torch.get_num_threads(), "new_tokens": args.new_tokens, "repeats": args.repeats,
                     "reference": type(theirs).__name__, "smoke": args.smoke}
    for batch in args.batches:
        prompts = prompts_for(batch, batch, contract)
        a, b, ids_ours, ids_hf = timed_pair(lambda: run_lmforge(ours, prompts, args.new_tokens, contract),
                                            lambda: run_hf(theirs, prompts, args.new_tokens, contract), args.repeats)
        n = batch * args.new_tokens
        results[f"batch_{batch}"] = {
            "lmforge_tok_s": n / a["wall"], "transformers_tok_s": n / b["wall"], "ratio": b["wall"] / a["wall"],
            "cpu_ratio": b["cpu"] / a["cpu"], "same_ids": ids_ours == ids_hf,
        }
        if args.compile:  # against the eager lmforge, interleaved the same way
            c, e, ids_c, ids_e = timed_pair(lambda: run_lmforge(ours, prompts, args.new_tokens, contract, True),
                                            lambda: run_lmforge(ours, prompts, args.new_tokens, contract),
                                            args.repeats)
            results[f"batch_{batch}"].update(compiled_tok_s=n / c["wall"], paired_eager_tok_s=n / e["wall"],
                                             compiled_vs_eager=e["wall"] / c["wall"],
                                             compiled_same_ids=ids_c == ids_e)
    results["seconds"] = time.perf_counter() - t0
    c = ours.config
    print(f"decode: greedy, {args.new_tokens} new tokens (no stopping), prompts of 16-32 tokens left-padded, "
          f"dim {c.dim} / {c.n_layers} layers / {c.n_heads}+{c.n_kv_heads} heads / vocab {contract.vocab_size}"
          f"{' / QK-norm' if c.qk_norm else ''}, fp32, {results['threads']} thread(s), median of {args.repeats}; "
          f"tokens/s = new tokens / wall time, prefill included" + (" (SMOKE RUN: figures mean nothing)"
                                                                     if args.smoke else ""))
    rows = []
    for batch in args.batches:
        r = results[f"batch_{batch}"]
        rows.append([batch, f"{r['lmforge_tok_s']:.1f}", f"{r['transformers_tok_s']:.1f}", f"{r['ratio']:.2f}x",
                     f"{r['cpu_ratio']:.2f}x", r["same_ids"]])
    print(common.table(["batch", "lmforge tok/s", f"transformers ({results['reference']}) tok/s", "ratio",
                        "CPU-time ratio", "same ids"], rows))
    if args.compile:
        print(common.table(["batch", "lmforge eager tok/s", "lmforge compiled tok/s", "compiled / eager",
                            "same ids"],
                           [[b, f"{results[f'batch_{b}']['paired_eager_tok_s']:.1f}",
                             f"{results[f'batch_{b}']['compiled_tok_s']:.1f}",
                             f"{results[f'batch_{b}']['compiled_vs_eager']:.2f}x",
                             results[f"batch_{b}"]["compiled_same_ids"]] for b in args.batches],
                           title="generate.compile (warm: the compile itself is in the warm-up)"))
    print(f"({results['seconds']:.0f} s in all)")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
