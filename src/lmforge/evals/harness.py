"""lmforge inside lm-evaluation-harness: a model class over lmforge's own forward pass and
KV-cache decoding, for any checkpoint lmforge takes (its own, LoRA runs, imported models): no
export step.

    pip install "lmforge[eval]"           # lm-eval
    lmforge-lm-eval run --model lmforge --model_args checkpoint=runs/speedrun/sft --tasks hellaswag --limit 100

`lmforge-lm-eval` (or `python -m lmforge.evals.harness`) is lm-eval's own command line (every
argument as `lm_eval` takes it) with the model "lmforge" registered first: lm-eval discovers
models only in its own package, so a plain `lm_eval --model lmforge` cannot find it. From Python: `register()` then
`lm_eval.simple_evaluate(model="lmforge", model_args="checkpoint=DIR", ...)`.

The class (`TemplateLM`, lm-eval's `docs/model_guide.md`): `loglikelihood` gets lm-eval's own
context / continuation encoding (`TemplateLM._encode_pair`: trailing spaces of the context moved to
the continuation) and scores with `evals.scoring.score_tokens` (fp32, batched by length, a long
input cut from the left); `loglikelihood_rolling` scores a document in lm-eval's rolling windows
of the model's context; `generate_until` decodes greedily (or at `temperature` with `do_sample`)
with lmforge's `generate` and cuts the text at the first `until` string.
"""

from __future__ import annotations

import sys

MODEL_NAME = "lmforge"
_registered: list = []


def register():
    """Register the "lmforge" model with lm-eval (idempotent); returns the class.

    Raises:
        ModuleNotFoundError: lm-eval is not installed (`pip install "lmforge[eval]"`).
    """
    if _registered:
        return _registered[0]
    import lm_eval.models  # noqa: F401  (lm-eval's own models first: its registry loads them only while empty)
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model

    @register_model(MODEL_NAME)
    class LmforgeLM(TemplateLM):
        """An lmforge checkpoint as an lm-eval model (module docstring).

        model_args: checkpoint=DIR (required), batch_size (16), max_gen_toks (256), device (cpu,
        or cuda when available)."""

        def __init__(self, checkpoint: str, batch_size: int | str = 16, max_gen_toks: int = 256,
                     device: str | None = None, **kwargs):
            super().__init__()
            _load_into(self, checkpoint, batch_size, max_gen_toks, device)

        @property
        def eot_token_id(self) -> int:
            return self.tok.eos_id

        @property
        def prefix_token_id(self) -> int:
            start = list(self.tok.contract.document_start)
            return start[0] if start else self.tok.eos_id

        @property
        def max_length(self) -> int:
            return self.model.config.max_seq_len

        def tok_encode(self, string: str, **kwargs) -> list[int]:
            return self.tok.encode(string)

        def tok_decode(self, tokens, **kwargs) -> str:
            return self.tok.decode(list(tokens))

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            return _score_requests(self, requests)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return _rolling_loglikelihoods(self, requests)

        def generate_until(self, requests, disable_tqdm: bool = False):
            return _generate_until(self, requests)

    _registered.append(LmforgeLM)
    return LmforgeLM


def _load_into(lm, checkpoint: str, batch_size: int | str, max_gen_toks: int, device: str | None) -> None:
    """`LmforgeLM.__init__`'s work: the checkpoint's model (fp32, eval mode) on `device` (the CPU
    where CUDA is asked for but absent), its tokenizer and path, the batch size and generation budget."""
    import torch

    from lmforge.loading import load_checkpoint
    if device and str(device).startswith("cuda") and not torch.cuda.is_available():
        print(f"lmforge: --device {device}: no CUDA here, running on the CPU", file=sys.stderr)
        device = "cpu"  # lm-eval's command line passes cuda by default
    lm.device_ = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, tok, _, path = load_checkpoint(checkpoint)
    lm.model = model.to(device=lm.device_, dtype=torch.float32).eval()
    lm.tok, lm.path = tok, path
    lm.batch_size_ = int(batch_size) if str(batch_size).isdigit() else 16
    lm.max_gen_toks = int(max_gen_toks)


def _score_requests(lm, requests) -> list[tuple[float, bool]]:
    """`_loglikelihood_tokens`: (cache key, context ids, continuation ids) requests -> (summed
    log-probability of the continuation, whether it is the greedy one) each, cached."""
    from lmforge.evals.scoring import score_tokens
    seqs = [(list(ctx) + list(cont), len(ctx)) for _, ctx, cont in requests]
    res = score_tokens(lm.model, seqs, lm.tok.pad_id, lm.batch_size_, lm.device_)
    out = []
    for (key, _, _), r in zip(requests, res):
        out.append((r.logprob, r.greedy))
        lm.cache_hook.add_partial("loglikelihood", key, (r.logprob, r.greedy))
    return out


def _rolling_loglikelihoods(lm, requests) -> list[float]:
    """`loglikelihood_rolling`: each document's log-likelihood, summed over lm-eval's rolling
    windows of the model's context, cached."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from lmforge.evals.scoring import score_tokens
    out = []
    for req in requests:
        (text,) = req.args
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
            lm.tok_encode(text), lm.prefix_token_id, lm.max_length, 1)]
        res = score_tokens(lm.model, [(ctx + pred, len(ctx)) for ctx, pred in windows], lm.tok.pad_id,
                           lm.batch_size_, lm.device_)
        total = sum(r.logprob for r in res)
        out.append(total)
        lm.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
    return out


def _generate_until(lm, requests) -> list[str]:
    """`generate_until`: each request's continuation (greedy, or sampled at its temperature),
    cut at the first of its `until` strings, cached."""
    from lmforge.config import SamplingConfig
    from lmforge.generate import generate
    from lmforge.runtime import decode_runtime
    out = []
    runtime = decode_runtime(lm.device_)
    for req in requests:
        context, gen = req.args[0], dict(req.args[1] or {})
        until = gen.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        n = int(gen.get("max_gen_toks", lm.max_gen_toks))
        temperature = float(gen.get("temperature", 0.0) or 0.0)
        greedy = not gen.get("do_sample", False) or temperature == 0.0
        sampling = SamplingConfig(max_new_tokens=n, greedy=greedy, temperature=temperature or 1.0, top_k=0,
                                  top_p=1.0, repetition_penalty=1.0)
        budget = lm.max_length - n  # the context's last tokens, its BOS kept in front (fit_prompt)
        ids = lm.tok.fit_prompt([lm.prefix_token_id, *lm.tok_encode(context)], budget)[-budget:]
        gen_ids = generate(lm.model, [ids], [lm.tok.eos_id], sampling, lm.tok.pad_id, truncate=True,
                           runtime=runtime)[0]
        text = lm.tok.decode([t for t in gen_ids if t != lm.tok.eos_id])
        for stop in until:
            if stop and stop in text:
                text = text[: text.index(stop)]
        out.append(text)
        lm.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
    return out


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with the "lmforge" model registered."""
    try:
        register()
        from lm_eval.__main__ import cli_evaluate
    except ModuleNotFoundError as exc:
        sys.exit(f"error: lm-evaluation-harness is not installed ({exc}): pip install \"lmforge[eval]\"")
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
