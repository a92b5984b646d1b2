"""Evaluation: loss (nats/token), perplexity and bits per byte equal a direct recomputation
(a plain forward per document, summed nats / ln 2 / UTF-8 bytes of the decoded text), and
`lmforge eval` prints them and writes them as JSON."""

from __future__ import annotations

import json
import lzma
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from lmforge.data.shards import Shard
from lmforge.errors import ContractError
from lmforge.evaluate import evaluate_shard, split_texts, xz_bits_per_byte
from lmforge.model import Transformer, resolve_model_config
from lmforge.stages import eval_stage
from lmforge.train.checkpoint import save_checkpoint

from conftest import tiny_config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_run):
    """A random tiny model (fp32) whose context fits every document of the tiny corpus."""
    cfg, tok = tiny_run
    tmp = tmp_path_factory.mktemp("eval")
    cfg = tiny_config(tmp, None, **{"tokenizer.dir": str(tok.folder), "data.dir": cfg.data.dir,
                                    "data.seq_len": 320, "model.max_seq_len": 320, "train.micro_batch_size": 3})
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    model.reset_parameters(seed=0)
    with torch.no_grad():
        model.output.weight.mul_(5)  # a loss far from ln(V): a scale mistake would show
    return save_checkpoint(tmp / "run", 1, model, cfg, tok.folder), model, cfg, tok


def direct(model, shard: Shard, tok) -> tuple[float, int, int]:
    """(total nats, targets, UTF-8 bytes): each document on its own, one plain causal forward."""
    nats, count, nbytes = 0.0, 0, 0
    with torch.inference_mode():
        for i in range(shard.n_documents):
            ids = torch.from_numpy(shard.document(i).astype("int64"))
            assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
            logits = model(ids[None, :-1])[0]
            nats += float(F.cross_entropy(logits.double(), ids[1:], reduction="sum"))
            count += len(ids) - 1
            nbytes += len(tok.decode(ids[1:-1].tolist()).encode("utf-8"))
    return nats, count, nbytes


@pytest.mark.parametrize("split", ["val", "train"])
def test_bits_per_byte_equals_a_direct_recomputation(checkpoint, tmp_path, split):
    path, model, cfg, tok = checkpoint
    shard = Shard.open(cfg.data.dir, split, tok.contract)
    assert int(shard.lengths().max()) - 1 <= cfg.data.seq_len  # every document in one piece
    out = tmp_path / "eval.json"
    res = eval_stage(path, cfg.data.dir, split, out)
    nats, count, nbytes = direct(model, shard, tok)
    assert res["tokens"] == count and res["bytes"] == nbytes
    assert res["loss"] == pytest.approx(nats / count, rel=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(nats / count), rel=1e-5)
    assert res["bits_per_byte"] == pytest.approx(nats / math.log(2) / nbytes, rel=1e-5)
    assert 1.0 < res["loss"] < 3 * math.log(tok.vocab_size)
    assert json.loads(out.read_text()) == res


def test_long_documents_are_scored_in_pieces_every_target_once(checkpoint):
    _, model, cfg, tok = checkpoint
    shard = Shard.open(cfg.data.dir, "val", tok.contract)
    res = evaluate_shard(model, shard, seq_len=16, batch_size=4)
    assert res["tokens"] == int(shard.lengths().sum()) - shard.n_documents
    assert res["bytes"] == sum(len(t.encode("utf-8")) for t in split_texts(shard, tok))


def test_cli_eval_prints_and_writes_json(checkpoint, tmp_path, capsys):
    from lmforge.cli import main

    path, _, cfg, _ = checkpoint
    out = tmp_path / "res" / "eval.json"
    assert main(["eval", "--checkpoint", str(path.parent), "--data", cfg.data.dir, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert "nats/token" in printed and "bits/byte" in printed and f"{res['bits_per_byte']:.4f}" in printed
    assert {"loss", "perplexity", "bits_per_byte", "tokens", "bytes", "checkpoint", "split"} <= set(res)


def test_eval_refuses_data_of_another_tokenizer(checkpoint, tmp_path):
    path, _, cfg, _ = checkpoint
    data = tmp_path / "data"
    shutil.copytree(cfg.data.dir, data)
    contract = json.loads((data / "contract.json").read_text())
    contract["tokenizer_sha256"] = "0" * 64
    (data / "contract.json").write_text(json.dumps(contract))
    with pytest.raises(ContractError, match="tokenizer_sha256"):
        eval_stage(path, data)


def test_xz_reference():
    text = ["def value(self):\n    return self.value\n" * 50]
    data = text[0].encode()
    assert xz_bits_per_byte(text) == 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / len(data)
    assert xz_bits_per_byte(text) < 1.0
    assert math.isnan(xz_bits_per_byte([]))
