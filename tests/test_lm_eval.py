"""E2: lmforge inside lm-evaluation-harness (`lmforge.evals.harness`) gives what lm-eval's own
HFLM gives on `lmforge export`'s folder — the same per-choice log-likelihoods within 1e-4 (fp32)
on a local multiple-choice task shipped in tests/lm_eval_task/ — and lm-eval's
`local-completions` model against `lmforge serve` (echo + logprobs, token-id prompts) gives them
too. Skipped without lm-eval (`make eval-interop` installs it and runs this file)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from lm_eval.tasks import TaskManager  # noqa: E402

from lmforge.evals.harness import register  # noqa: E402
from lmforge.export import export_hf  # noqa: E402
from lmforge.model import Transformer, resolve_model_config  # noqa: E402
from lmforge.train.checkpoint import save_checkpoint  # noqa: E402

DATA = Path(__file__).resolve().parent / "lm_eval_task" / "lmforge_local_mc.jsonl"
TASK = "lmforge_local_mc"


@pytest.fixture(scope="module")
def setup(tiny_run, tmp_path_factory):
    cfg, tok = tiny_run
    tmp = tmp_path_factory.mktemp("lm_eval")
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    model.reset_parameters(seed=0)
    with torch.no_grad():
        model.output.weight.mul_(20)  # opinions, so that the choices differ
    ckpt = save_checkpoint(tmp / "run", 1, model, cfg, tok.folder)
    hf = export_hf(ckpt, tmp / "hf")
    tasks = tmp / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {DATA}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: \"{{query}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{gold}}\"\nmetric_list:\n  - metric: acc\nmetadata:\n  version: 1.0\n")
    register()
    return ckpt, hf, TaskManager(include_path=str(tasks))


def loglikelihoods(model: str, model_args: str, manager) -> list[float]:
    res = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], task_manager=manager,
                                  log_samples=True, batch_size=4)
    samples = sorted(res["samples"][TASK], key=lambda s: s["doc_id"])
    return [float(r[0]) for s in samples for r in s["filtered_resps"]]


def test_e2_the_adapter_equals_hflm_on_the_export(setup):
    ckpt, hf, manager = setup
    ours = loglikelihoods("lmforge", f"checkpoint={ckpt}", manager)
    theirs = loglikelihoods("hf", f"pretrained={hf},dtype=float32,device=cpu", manager)
    assert len(ours) == len(theirs) == 15
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-4
    assert len(set(round(x, 3) for x in ours)) > 4  # the choices really differ


def test_e2_local_completions_against_lmforge_serve(setup):
    pytest.importorskip("tenacity")
    pytest.importorskip("starlette")
    from lmforge.loading import load_checkpoint
    from lmforge.serve import build_server
    from serve_harness import Running

    ckpt, hf, manager = setup
    model, tok, _, _ = load_checkpoint(ckpt)
    run = Running(build_server(model, tok, "tiny", max_batch=4, max_queue=16, max_tokens=16))
    try:
        served = loglikelihoods("local-completions", f"model=tiny,base_url={run.url}/v1/completions,"
                                f"tokenizer_backend=huggingface,tokenizer={hf},tokenized_requests=True", manager)
    finally:
        run.stop()
    ours = loglikelihoods("lmforge", f"checkpoint={ckpt}", manager)
    assert max(abs(a - b) for a, b in zip(ours, served)) < 1e-4
