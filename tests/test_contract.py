"""The contract (P1, P4, P6): tokenizer, data, model and checkpoint agree, and every stage
boundary stops with one clear message when they do not.

The six bad inputs of issue 3 run the real command (`lmforge.cli.main`, and the console
script once) and assert: a non-zero exit, one `error:` line without a traceback, and that
nothing on disk changed (no file half-written). Then the permuted-ids pipeline, the
pad == eos import pipeline, and `pretrain --dry-run`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, tiny_config

from lmforge.cli import main
from lmforge.contract import padded_vocab_size
from lmforge.contract import CONTRACT_FILE, Contract, check_match, file_sha256, tokenizer_sha256
from lmforge.data.packing import build_row, shard_stream
from lmforge.data.shards import Shard, preflight
from lmforge.errors import ContractError
from lmforge.model import Transformer, resolve_model_config
from lmforge.stages import eval_stage, prepare_stage, pretrain_stage
from lmforge.tokenizer import SPECIAL_TOKENS, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, import_tokenizer, train_tokenizer


# -- helpers ------------------------------------------------------------------------------
def corpus_texts(corpus: Path) -> list[str]:
    return [p.read_text() for p in sorted(corpus.glob("*.py"))]


def tree(*roots: Path) -> dict[str, str]:
    """Every path under `roots` with the sha256 of its content: equal before and after = nothing
    written, nothing half-written."""
    state = {}
    for root in map(Path, roots):
        state[str(root)] = "dir" if root.is_dir() else ("missing" if not root.exists() else "file")
        for p in sorted(root.rglob("*")) if root.is_dir() else []:
            state[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return state


def cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    line = err[err.index("error:"):]
    for n in needles:
        assert n in line, f"{n!r} not in {line!r}"


def write_config(path: Path, cfg) -> Path:
    cfg.save(path)
    return path


@pytest.fixture(scope="module")
def tok_b(tmp_path_factory, tiny_corpus):
    """Tokenizer B: another vocab size on the same corpus."""
    return train_tokenizer(corpus_texts(tiny_corpus), 320, tmp_path_factory.mktemp("tokb") / "tok",
                           show_progress=False)


@pytest.fixture(scope="module")
def data_b(tmp_path_factory, tiny_run, tok_b):
    cfg, _ = tiny_run
    out = tmp_path_factory.mktemp("datab") / "data"
    prepare_stage(dataclasses.replace(cfg, tokenizer=dataclasses.replace(cfg.tokenizer, dir=str(tok_b.folder))),
                  out, progress=False)
    return out


@pytest.fixture(scope="module")
def run_a(tmp_path_factory, tiny_run):
    """A 2-step run trained with tokenizer A (the conftest tokenizer)."""
    cfg, _ = tiny_run
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=2))
    out = tmp_path_factory.mktemp("runa") / "run"
    pretrain_stage(cfg, out, progress=False)
    return out


@pytest.fixture
def cfg_file(tiny_run, tmp_path) -> Path:
    cfg, _ = tiny_run
    return write_config(tmp_path / "cfg.toml", cfg)


# -- 1. a checkpoint trained with A, generated from with B --------------------------------
def test_generate_with_another_tokenizer_fails(capsys, run_a, tok_b, tmp_path):
    before = tree(run_a, tok_b.folder)
    rc, out, err = cli(capsys, "generate", "--checkpoint", run_a, "--tokenizer", tok_b.folder, "--prompt", "def",
                       "--max-new-tokens", "4")
    assert_one_error(rc, err, "contract mismatch", str(tok_b.folder / CONTRACT_FILE),
                     str(run_a / "step_000002" / CONTRACT_FILE), tok_b.contract.tokenizer_sha256,
                     f"'vocab_size': {tok_b.folder / CONTRACT_FILE} has {tok_b.vocab_size} but")
    assert out == "" and tree(run_a, tok_b.folder) == before
    # the checkpoint's own tokenizer works (the same command, without the wrong --tokenizer)
    rc, out, err = cli(capsys, "generate", "--checkpoint", run_a, "--prompt", "def", "--max-new-tokens", "4",
                       "--greedy")
    assert rc == 0 and out.startswith("def"), err


def test_eval_on_data_from_another_tokenizer_fails(capsys, run_a, data_b, tmp_path):
    before = tree(run_a, data_b, tmp_path)
    rc, _, err = cli(capsys, "eval", "--checkpoint", run_a, "--data", data_b, "--out", tmp_path / "res.json")
    assert_one_error(rc, err, "contract mismatch", str(data_b / CONTRACT_FILE))
    assert tree(run_a, data_b, tmp_path) == before


# -- 2. shards prepared with A, pretrained on with B --------------------------------------
def test_pretrain_on_shards_from_another_tokenizer_fails(capsys, cfg_file, tiny_run, tok_b, tmp_path):
    cfg, _ = tiny_run
    data_a = Path(cfg.data.dir)
    before = tree(tmp_path, data_a, tok_b.folder)
    rc, _, err = cli(capsys, "pretrain", "--config", cfg_file, "--set", f"tokenizer.dir={tok_b.folder}",
                     "--out", tmp_path / "run", "--no-progress")
    assert_one_error(rc, err, "contract mismatch", str(tok_b.folder / CONTRACT_FILE), str(data_a / CONTRACT_FILE))
    assert tree(tmp_path, data_a, tok_b.folder) == before


def test_resume_with_another_tokenizer_fails(capsys, tiny_run, run_a, tok_b, data_b, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_a, run)
    cfg, _ = tiny_run
    cfg_path = write_config(tmp_path / "cfg.toml", cfg)
    before = tree(tmp_path)
    rc, _, err = cli(capsys, "pretrain", "--config", cfg_path, "--set", f"tokenizer.dir={tok_b.folder}",
                     "--set", f"data.dir={data_b}", "--set", "train.steps=4", "--resume", "--out", run,
                     "--no-progress")
    assert_one_error(rc, err, "contract mismatch", str(tok_b.folder / CONTRACT_FILE),
                     str(run / "step_000002" / CONTRACT_FILE))
    assert tree(tmp_path) == before


# -- 3. model.vocab_size set by hand below the tokenizer's vocab ---------------------------
@pytest.mark.parametrize("dry_run", [False, True])
def test_model_vocab_below_tokenizer_vocab_fails(capsys, cfg_file, tiny_run, tmp_path, monkeypatch, dry_run):
    cfg, tok = tiny_run
    allocated = []
    monkeypatch.setattr(Transformer, "__init__", lambda self, c: allocated.append(c) or pytest.fail("allocated"))
    before = tree(tmp_path, Path(cfg.data.dir))
    rc, _, err = cli(capsys, "pretrain", "--config", cfg_file, "--set", "model.vocab_size=256", "--out",
                     tmp_path / "run", *(["--dry-run"] if dry_run else []))
    assert_one_error(rc, err, "model.vocab_size = 256", f"vocab size {tok.vocab_size}")
    assert allocated == [] and tree(tmp_path, Path(cfg.data.dir)) == before


# -- 4. a shard holding a token id >= vocab size -------------------------------------------
@pytest.mark.parametrize("split, bad_id", [("train", "vocab_size"), ("val", 65535)])
def test_shard_with_out_of_range_id_fails(capsys, cfg_file, tiny_run, tmp_path, split, bad_id):
    cfg, tok = tiny_run
    bad_id = tok.vocab_size if bad_id == "vocab_size" else bad_id  # the first id past the vocab, or the dtype's max
    data = tmp_path / "data"
    shutil.copytree(cfg.data.dir, data)
    offsets = np.fromfile(data / f"{split}.idx", dtype=np.int64)
    at = int(offsets[1]) + 2  # inside document 1, not its last token
    arr = np.memmap(data / f"{split}.bin", dtype=np.uint16, mode="r+")
    arr[at] = bad_id
    arr.flush()
    del arr
    before = tree(tmp_path)
    rc, _, err = cli(capsys, "pretrain", "--config", cfg_file, "--set", f"data.dir={data}", "--out",
                     tmp_path / "run", "--no-progress")
    assert_one_error(rc, err, str(data / f"{split}.bin"), f"token id {bad_id} at offset {at}",
                     f"vocab size {tok.vocab_size}")
    assert tree(tmp_path) == before


def test_eval_checks_shard_ids_before_any_forward(capsys, run_a, tiny_run, tmp_path, monkeypatch):
    cfg, tok = tiny_run
    monkeypatch.setattr(Transformer, "forward", lambda *a, **k: pytest.fail("forward ran"))
    data = tmp_path / "data"
    shutil.copytree(cfg.data.dir, data)
    arr = np.memmap(data / "val.bin", dtype=np.uint16, mode="r+")
    arr[1] = tok.vocab_size + 1
    arr.flush()
    del arr
    rc, _, err = cli(capsys, "eval", "--checkpoint", run_a, "--data", data)
    assert_one_error(rc, err, "val.bin", f"token id {tok.vocab_size + 1} at offset 1")


# -- 5. a tokenizer folder without an end-of-text token -------------------------------------
def foreign_without_eos(folder: Path) -> Path:
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x\n"] * 20, trainer=trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<unk>", "<|stop|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(folder))
    assert "eos_token" not in json.loads((folder / TOKENIZER_CONFIG_FILE).read_text())
    return folder


def test_import_tokenizer_without_eos_fails(capsys, tmp_path):
    src = foreign_without_eos(tmp_path / "hf")
    before = tree(tmp_path)
    rc, _, err = cli(capsys, "import-tokenizer", "--from", src, "--out", tmp_path / "tok")
    assert_one_error(rc, err, "no document terminator", str(src / TOKENIZER_CONFIG_FILE), "--set tokenizer.eos_token=")
    assert tree(tmp_path) == before  # no tok/, no tok.tmp/
    # and a stage pointed straight at the foreign folder says to import it
    rc, _, err = cli(capsys, "prepare", "--set", f"tokenizer.dir={src}", "--out", tmp_path / "data")
    assert_one_error(rc, err, "import-tokenizer --from")
    assert tree(tmp_path) == before


def test_import_tokenizer_console_script(capsys, tmp_path):
    """The installed `lmforge` command itself refuses it; then, with eos_token set (in the folder, or
    by the setting tokenizer.eos_token), it imports."""
    src = foreign_without_eos(tmp_path / "hf")
    script = Path(sys.executable).parent / "lmforge"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "lmforge"]
    p = subprocess.run([*cmd, "import-tokenizer", "--from", str(src), "--out", str(tmp_path / "tok")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("error:") == 1 and "Traceback" not in p.stderr, p.stderr
    assert "no document terminator" in p.stderr and not (tmp_path / "tok").exists()
    rc, _, err = cli(capsys, "import-tokenizer", "--from", src, "--out", tmp_path / "tok0",
                     "--set", "tokenizer.eos_token=<|stop|>")
    assert rc == 0, err
    assert Contract.load(tmp_path / "tok0").eos_id == Contract.load(tmp_path / "tok0").special_tokens["eos"]
    cfg = json.loads((src / TOKENIZER_CONFIG_FILE).read_text())
    (src / TOKENIZER_CONFIG_FILE).write_text(json.dumps(cfg | {"eos_token": "<|stop|>"}))
    rc, _, err = cli(capsys, "import-tokenizer", "--from", src, "--out", tmp_path / "tok")
    assert rc == 0, err
    c = Contract.load(tmp_path / "tok")
    assert "adding it" in err and f"eos={c.eos_id} '<|stop|>'" in err and f"pad={c.pad_id} '<|pad|>'" in err


# -- 6. a contract edited by hand so its hash no longer matches ------------------------------
def _edit_hash(folder: Path) -> str:
    raw = json.loads((folder / CONTRACT_FILE).read_text())
    raw["tokenizer_sha256"] = hashlib.sha256(b"edited by hand").hexdigest()
    (folder / CONTRACT_FILE).write_text(json.dumps(raw))
    return "tokenizer_sha256"


def _edit_tokenizer_json(folder: Path) -> str:
    """A merge dropped (what decides ids: a new line at the end would not change the hash)."""
    raw = json.loads((folder / TOKENIZER_FILE).read_text())
    raw["model"]["merges"] = raw["model"]["merges"][:-1]
    (folder / TOKENIZER_FILE).write_text(json.dumps(raw))
    return "hashes to"


def _swap_ids(folder: Path) -> str:
    raw = json.loads((folder / CONTRACT_FILE).read_text())
    st = raw["special_tokens"]
    st["eos"], st["bos"] = st["bos"], st["eos"]
    (folder / CONTRACT_FILE).write_text(json.dumps(raw))
    return "special_tokens"


@pytest.mark.parametrize("edit", [_edit_hash, _edit_tokenizer_json, _swap_ids])
@pytest.mark.parametrize("command", ["prepare", "pretrain"])
def test_edited_contract_fails(capsys, cfg_file, tiny_run, tmp_path, edit, command):
    cfg, tok = tiny_run
    folder = tmp_path / "tok"
    shutil.copytree(tok.folder, folder)
    needle = edit(folder)
    before = tree(tmp_path, Path(cfg.data.dir))
    rc, _, err = cli(capsys, command, "--config", cfg_file, "--set", f"tokenizer.dir={folder}",
                     "--out", tmp_path / "out", "--no-progress")
    assert_one_error(rc, err, str(folder / CONTRACT_FILE), needle)
    assert tree(tmp_path, Path(cfg.data.dir)) == before


# -- the contract itself ---------------------------------------------------------------------
def test_contract_consistency_checks(tiny_tokenizer, tmp_path):
    c = tiny_tokenizer.contract
    assert c.vocab_size == tiny_tokenizer.hf.get_vocab_size(with_added_tokens=True) <= TINY_VOCAB
    assert c.model_vocab_size == padded_vocab_size(c.vocab_size) and c.model_vocab_size % 64 == 0
    assert c.tokenizer_sha256 == tokenizer_sha256(tiny_tokenizer.folder / TOKENIZER_FILE)
    bad = {
        "share ids": dataclasses.replace(c, special_tokens={**c.special_tokens, "pad": c.eos_id}),
        "outside the vocab": dataclasses.replace(c, special_tokens={**c.special_tokens, "pad": c.vocab_size}),
        "rounded up to 64": dataclasses.replace(c, model_vocab_size=c.vocab_size + 1),
        "cannot hold": dataclasses.replace(c, token_dtype="uint32"),
    }
    for match, contract in bad.items():
        with pytest.raises(ContractError, match=match):
            contract.check_consistent("x")
        contract.save(tmp_path)
        with pytest.raises(ContractError, match=match):
            Contract.load(tmp_path)
    raw = json.loads(c.to_json())
    (tmp_path / CONTRACT_FILE).write_text(json.dumps(raw | {"surprise": 1}))
    with pytest.raises(ContractError, match="unexpected fields \\['surprise'\\]"):
        Contract.load(tmp_path)
    other = dataclasses.replace(c, special_tokens={**c.special_tokens, "eos": c.bos_id, "bos": c.eos_id})
    with pytest.raises(ContractError, match="'special_tokens': A has .* but B has"):
        check_match(c, "A", other, "B")
    check_match(c, "A", Contract.load(tiny_tokenizer.folder), "B")


def test_checkpoint_and_data_carry_the_tokenizer_contract(run_a, tiny_run):
    cfg, tok = tiny_run
    for folder in (Path(cfg.data.dir), run_a, run_a / "step_000002"):
        assert Contract.load(folder) == tok.contract
    assert Transformer.from_checkpoint(run_a).vocab_size == tok.vocab_size


# -- no literal token ids: special tokens declared in another order ------------------------
PERMUTED = [SPECIAL_TOKENS[n] for n in ("im_start", "eos", "im_end", "pad", "bos")]


@pytest.mark.slow
def test_permuted_special_ids_pipeline(capsys, tiny_corpus, tiny_tokenizer, tmp_path, monkeypatch):
    tok = train_tokenizer(corpus_texts(tiny_corpus), TINY_VOCAB, tmp_path / "tok", special_tokens=PERMUTED,
                          show_progress=False)
    c, default = tok.contract, tiny_tokenizer.contract
    for name, text in SPECIAL_TOKENS.items():
        assert c.special_tokens[name] == tok.hf.token_to_id(text) == PERMUTED.index(text)
        assert c.special_tokens[name] != default.special_tokens[name], name  # every id moved
    cfg = tiny_config(tmp_path, tiny_corpus, **{"train.steps": 3})
    cfg_path = write_config(tmp_path / "cfg.toml", cfg)
    # prepare: every document is [bos] text [eos] with the permuted ids, no special id inside
    rc, _, err = cli(capsys, "prepare", "--config", cfg_path, "--no-progress")
    assert rc == 0, err
    specials = set(c.special_tokens.values())
    n_docs = 0
    for split in ("train", "val"):
        shard = Shard.open(cfg.data.dir, split, c, tmp_path / "tok" / CONTRACT_FILE)
        for i in range(shard.n_documents):
            d = shard.document(i)
            assert d[0] == c.bos_id and d[-1] == c.eos_id and not specials & set(d[1:-1].tolist())
            n_docs += 1
    assert n_docs == 40
    report = preflight(cfg.data.dir, c, tmp_path / "tok" / CONTRACT_FILE)
    assert all(r["max_id"] < c.vocab_size for r in report.values())
    # batches: padding slots hold the permuted pad id and are never supervised; every EOS is learned
    train = Shard.open(cfg.data.dir, "train", c)
    stream = shard_stream(train, cfg.data.seq_len, 4, seed=0, shuffle=False)
    rows = [build_row(r, stream.get_tokens, None, cfg.data.seq_len, stream.pad_id) for r in stream.plan(0)]
    tokens = np.stack([r["tokens"] for r in rows])
    targets = np.stack([r["targets"] for r in rows])
    mask = np.stack([r["loss_mask"] for r in rows])
    assert stream.pad_id == c.pad_id and (~mask).any()
    assert (tokens[~mask] == c.pad_id).all() and (targets[~mask] == c.pad_id).all()
    assert int((targets[mask] == c.eos_id).sum()) == train.n_documents
    assert not (tokens[mask] == c.eos_id).any()  # EOS is never an input (P2)
    # pretrain a few steps
    rc, out, err = cli(capsys, "pretrain", "--config", cfg_path, "--out", tmp_path / "run", "--no-progress")
    assert rc == 0, err
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(math.isfinite(m["loss"]) for m in metrics)
    assert Contract.load(tmp_path / "run" / "step_000003") == c
    # generation stops at the permuted EOS, not at the id EOS has in the default order
    default_eos = default.eos_id
    assert default_eos == c.im_end_id  # with this permutation, the old EOS id is <|im_end|>
    real_hidden, real_logits = Transformer.hidden, Transformer.logits
    last = {}

    def hidden(self, tokens, *args, **kwargs):  # remember each row's newest input token
        last["tok"] = tokens[:, -1]
        return real_hidden(self, tokens, *args, **kwargs)

    def logits(self, h, product=None):  # after any token but the old EOS id: the old EOS id; after it: EOS
        out = real_logits(self, h, product)
        want = torch.where(last["tok"] == default_eos, c.eos_id, default_eos)
        boost = torch.nn.functional.one_hot(want, out.shape[-1]).to(out.dtype) * 1e4  # (B, V)
        return out + (boost[:, None] if out.dim() == 3 else boost)

    real_decode = Transformer.decode_step

    def decode_step(self, tokens, *args, **kwargs):  # the fused decode path ends in model.logits: same rule
        last["tok"] = tokens
        return real_decode(self, tokens, *args, **kwargs)

    monkeypatch.setattr(Transformer, "hidden", hidden)
    monkeypatch.setattr(Transformer, "logits", logits)
    monkeypatch.setattr(Transformer, "decode_step", decode_step)
    import lmforge.generate as generate_mod  # its CPU fast path bypasses model.logits: use it
    monkeypatch.setattr(generate_mod, "output_projection", lambda model: model.logits)
    rc, out, err = cli(capsys, "generate", "--checkpoint", tmp_path / "run", "--tokenizer", tmp_path / "tok",
                       "--prompt", "def", "--greedy", "--max-new-tokens", "8")
    assert rc == 0, err
    assert out == "def<|im_end|>\n"  # one old-EOS id (plain <|im_end|> here), then the real EOS: stop
    monkeypatch.undo()
    res = eval_stage(tmp_path / "run")
    assert math.isfinite(res["loss"]) and res["tokens"] > 0


# -- bring your own tokenizer, pad == eos, through prepare -----------------------------------
def test_imported_pad_equals_eos_tokenizer_pipeline(tiny_corpus, tmp_path):
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(corpus_texts(tiny_corpus), trainer=trainers.BpeTrainer(
        vocab_size=330, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    hf.add_special_tokens([AddedToken(t, special=True) for t in ("<|begin_of_text|>", "<|end_of_text|>")])
    PreTrainedTokenizerFast(tokenizer_object=hf, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                            pad_token="<|end_of_text|>").save_pretrained(str(tmp_path / "hf"))
    tok = import_tokenizer(tmp_path / "hf", tmp_path / "tok")
    c = tok.contract
    assert c.eos_id == hf.token_to_id("<|end_of_text|>") and c.pad_id not in (c.eos_id, c.bos_id)
    cfg = tiny_config(tmp_path, tiny_corpus)
    prepare_stage(cfg, progress=False)
    report = preflight(cfg.data.dir, c, tmp_path / "tok" / CONTRACT_FILE)
    assert all(r["max_id"] < c.vocab_size for r in report.values())
    train = Shard.open(cfg.data.dir, "train", c)
    assert (train.tokens[train.offsets[1:] - 1] == c.eos_id).all()
    stream = shard_stream(train, cfg.data.seq_len, 4, seed=0, shuffle=False)
    rows = [build_row(r, stream.get_tokens, None, cfg.data.seq_len, stream.pad_id) for r in stream.plan(0)]
    tokens, targets, mask = (np.stack([r[k] for r in rows]) for k in ("tokens", "targets", "loss_mask"))
    # the EOS that ends each document is learned even though the source tokenizer's pad was EOS
    assert int((targets[mask] == c.eos_id).sum()) == train.n_documents
    assert (~mask).any() and (tokens[~mask] == c.pad_id).all()
    model = Transformer(resolve_model_config(tiny_config(tmp_path).model, c))
    assert model.vocab_size == c.vocab_size and model.model_vocab_size == c.model_vocab_size


# -- pretrain --dry-run -------------------------------------------------------------------------
def test_pretrain_dry_run_reports_and_writes_nothing(capsys, tiny_run, tmp_path, monkeypatch):
    cfg, tok = tiny_run
    cfg_path = write_config(tmp_path / "cfg.toml", cfg)
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path, Path(cfg.data.dir), tok.folder)
    rc, out, err = cli(capsys, "pretrain", "--config", cfg_path, "--dry-run", "--out", tmp_path / "run",
                       "--set", "train.grad_accum_steps=3")
    assert rc == 0, err
    assert tree(tmp_path, Path(cfg.data.dir), tok.folder) == before  # no run folder, nothing in cwd
    c = tok.contract
    model = Transformer(resolve_model_config(cfg.model, c))
    assert f"{model.num_parameters():,} parameters" in err
    assert f"dim {cfg.model.dim}, {cfg.model.n_layers} layers" in err
    assert f"vocab: tokenizer {c.vocab_size}, model {c.model_vocab_size}" in err
    assert ", ".join(f"{k}={v}" for k, v in c.special_tokens.items()) in err
    meta = json.loads((Path(cfg.data.dir) / "meta.json").read_text())["splits"]
    for split in ("train", "val"):
        shard = Shard.open(cfg.data.dir, split)
        assert meta[split]["documents"] == shard.n_documents
        line = (f"data {split}: {shard.n_documents:,} documents, {shard.n_tokens:,} tokens, "
                f"max id {int(np.asarray(shard.tokens).max())}")
        assert line in err
    per_step = cfg.train.micro_batch_size * 3 * cfg.data.seq_len
    assert f"= {per_step:,} tokens/step" in err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["dry_run"] is True and abs(res["loss"] - math.log(c.vocab_size)) < 1.0
    assert "all checks passed" in err and "error:" not in err


def test_tokenizer_json_that_is_json_but_not_a_tokenizer_is_a_contract_error(tiny_tokenizer, tmp_path):
    """Valid JSON, the contract's hash updated to match, yet not a tokenizer: a ContractError naming
    the file, not the `tokenizers` library's bare Exception."""
    from lmforge.tokenizer import Tokenizer

    folder = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer.folder, folder)
    (folder / TOKENIZER_FILE).write_text('{"version": "1.0", "model": {"type": "nothing"}}', encoding="utf-8")
    contract = json.loads((folder / CONTRACT_FILE).read_text())
    contract["tokenizer_sha256"] = file_sha256(folder / TOKENIZER_FILE)
    (folder / CONTRACT_FILE).write_text(json.dumps(contract))
    with pytest.raises(ContractError, match=r"tokenizer\.json is not a tokenizer the `tokenizers` library can read"):
        Tokenizer.load(folder)
