"""End to end on the tiny corpus: tokenizer -> prepare -> pretrain -> generate -> eval."""

import json

import torch

from lmforge.loading import load_checkpoint
from lmforge.model import Transformer
from lmforge.stages import eval_stage, generate_text, pretrain_stage
from lmforge.generate import SamplingConfig


def test_pipeline_trains_and_loads(tiny_run, tmp_path):
    cfg, tok = tiny_run
    from dataclasses import replace
    cfg = replace(cfg, train=replace(cfg.train, steps=12))
    last = pretrain_stage(cfg, tmp_path / "run", progress=False)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert last["val_loss"] is not None
    model = Transformer.from_checkpoint(tmp_path / "run")
    assert model.vocab_size == tok.vocab_size
    x = torch.tensor([[tok.bos_id, *tok.encode("def value")]])
    assert model(x).shape == (1, x.shape[1], tok.vocab_size)
    model2, tok2, _, _ = load_checkpoint(tmp_path / "run")
    torch.testing.assert_close(model(x), model2(x), rtol=0, atol=0)
    text = generate_text(model2, tok2, "def ", SamplingConfig(max_new_tokens=8), seed=0)
    assert text.startswith("def ")
    res = eval_stage(tmp_path / "run")
    assert res["bits_per_byte"] > 0 and res["tokens"] > 0
