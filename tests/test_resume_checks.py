"""`--resume` is exact or refused (lmforge.train.resume), and a refusal changes no file.

- The table: every config field has exactly one rule (a new field cannot slip past).
- Each refused change (one row: field, value) raises CheckpointError naming the field,
  before any file is written (a before/after hash of the run folder); for SFT the [sft] key
  is named. A few rows run the command line: exit 2, one `error:` line.
- Allowed changes resume; schedule changes that leave the steps taken as they were resume
  to the very run a straight start with the new value gives (bit-identical losses).
- optimizer.pt of the wrong shape, with a missing key, of another optimizer (AdamW given to
  Muon and back), with edited hyperparameters or non-finite moments; rng.pt truncated or of
  the wrong shape: a clear CheckpointError naming the file, never a KeyError or a traceback.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "robustness"))
from test_bad_inputs import C, conversations, project, tree_hash  # noqa: E402,F401  (project: a fixture)
from test_resume import _trainer, read_metrics, sigterm_at, with_train  # noqa: E402

from lmforge.cli import main  # noqa: E402
from lmforge.config import SECTIONS, Config  # noqa: E402
from lmforge.errors import CheckpointError  # noqa: E402
from lmforge.stages import pretrain_stage, sft_stage  # noqa: E402
from lmforge.train import checkpoint as ckpt  # noqa: E402
from lmforge.train.resume import RESUME_RULES, STAGES, check_resume_config  # noqa: E402


def test_every_config_field_has_exactly_one_rule():
    fields = [f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(type(getattr(Config(), s)))]
    ruled = [r.field for r in RESUME_RULES]
    assert len(ruled) == len(set(ruled))
    assert sorted(ruled) == sorted(fields)
    assert all(r.why.strip() for r in RESUME_RULES)
    # a field refused in one stage only, or only for some runs, says why a change is safe elsewhere
    partial = [r.field for r in RESUME_RULES if (r.refused_in and set(r.refused_in) != set(STAGES)) or r.when]
    assert partial and all(r.otherwise.strip() for r in RESUME_RULES if r.field in partial)


def _set(cfg: Config, field: str, value) -> Config:
    section, key = field.split(".", 1)
    return replace(cfg, **{section: replace(getattr(cfg, section), **{key: value})})


# -- a pretraining run stopped at step 2 of 4 --------------------------------------------------------
@pytest.fixture(scope="module")
def half_run(tiny_run, tmp_path_factory):
    """(config, run folder): 4 steps planned, SIGTERM after step 2 (step_000002 written)."""
    cfg, _ = tiny_run
    cfg = with_train(cfg, steps=4, checkpoint_every=0, keep_last=0)
    run = tmp_path_factory.mktemp("half") / "run"
    with pytest.MonkeyPatch.context() as mp:
        sigterm_at(mp, 2)
        last = pretrain_stage(cfg, run, progress=False)
    assert last["step"] == 2 and last["interrupted"]
    return cfg, run


@pytest.fixture
def run_copy(half_run, tmp_path):
    cfg, run = half_run
    shutil.copytree(run, tmp_path / "run")
    return cfg, tmp_path / "run"


def refused(stage, cfg, run: Path, match: str, **kw) -> None:
    """`stage` with --resume raises CheckpointError matching `match`, and no file changes."""
    before = tree_hash(run.parent)
    with pytest.raises(CheckpointError) as exc:
        stage(cfg, run, resume=True, progress=False, **kw)
    assert re.search(match, str(exc.value), re.S), str(exc.value)
    assert tree_hash(run.parent) == before, "a refused --resume changed files"


PRETRAIN_REFUSED = [
    ("data.seq_len", 32), ("data.document_masking", False),
    ("model.dim", 64), ("model.n_layers", 3), ("model.n_heads", 8), ("model.n_kv_heads", 4),
    ("model.ffn_dim", 192), ("model.norm_eps", 1e-6), ("model.rope_theta", 5e5),
    ("model.max_seq_len", 256), ("model.tie_embeddings", True), ("model.qk_norm", False),
    ("model.attention", "sdpa"),
    ("train.micro_batch_size", 2), ("train.grad_accum_steps", 2),
    ("train.weight_decay", 0.0), ("train.beta1", 0.8), ("train.beta2", 0.99), ("train.grad_clip", 0.5),
    ("train.zero_init", False), ("train.optimizer", "adamw"), ("train.muon_lr_scale", 2.0),
    ("train.muon_momentum", 0.9), ("train.muon_ns_steps", 3), ("train.embed_lr_scale", 2.0),
    ("train.head_lr_scale", 0.5), ("train.seed", 7), ("train.precision", "auto"), ("train.compile", True),
    # schedule fields that change the learning rate of step 1 or 2 (already taken)
    ("train.lr", 0.02), ("train.warmup_steps", 2), ("train.decay_fraction", 0.9), ("train.steps", 3),
]


@pytest.mark.parametrize("field,value", PRETRAIN_REFUSED, ids=[f"{f}={v}" for f, v in PRETRAIN_REFUSED])
def test_pretrain_resume_refuses_a_change_that_breaks_exactness(run_copy, field, value):
    cfg, run = run_copy
    new = _set(cfg, field, value)
    if field == "model.dim":
        new = _set(new, "model.n_heads", 4)
    refused(pretrain_stage, new, run, rf"{re.escape(field)} = {re.escape(repr(value))}")


def test_pretrain_resume_refuses_another_data_folder(run_copy, tmp_path):
    cfg, run = run_copy
    shutil.copytree(cfg.data.dir, tmp_path / "data2")  # the same shards elsewhere: still refused (another folder)
    refused(pretrain_stage, _set(cfg, "data.dir", str(tmp_path / "data2")), run, r"data\.dir = ")


def test_the_same_data_folder_spelled_another_way_is_the_same(run_copy, monkeypatch):
    cfg, run = run_copy
    data = Path(cfg.data.dir)
    monkeypatch.chdir(data.parent)
    last = pretrain_stage(_set(cfg, "data.dir", f"./{data.name}/../{data.name}"), run, resume=True, progress=False)
    assert last["step"] == 4


def test_the_schedule_refusal_names_the_step_and_both_rates(run_copy):
    cfg, run = run_copy
    refused(pretrain_stage, _set(cfg, "train.steps", 3), run,
            r"train\.steps = 3 \(the run has 4\): step 2 of the run already took learning rate 0\.01, and with "
            r"the new value it would be 0\.0066666667")


def test_several_refused_fields_are_named_together(run_copy):
    cfg, run = run_copy
    refused(pretrain_stage, _set(_set(cfg, "train.seed", 9), "train.beta1", 0.5), run,
            r"train\.beta1 = 0\.5 \(the run has 0\.9\).*train\.seed = 9 \(the run has 1337\)")


# -- allowed changes ---------------------------------------------------------------------------------
PRETRAIN_ALLOWED = [
    ("train.checkpoint_every", 1), ("train.keep_last", 1), ("train.eval_every", 1), ("train.eval_tokens", 128),
    ("train.log_every", 5), ("train.time_limit_s", 3600.0), ("train.global_batch_size", 4),
    ("train.data_parallel", "fsdp"), ("tokenizer.vocab_size", 512), ("tokenizer.max_train_bytes", 10),
    ("data.source", "elsewhere"), ("data.val_fraction", 0.5), ("data.include_tests", True),
    ("data.on_bad_utf8", "error"), ("sft.steps", 9), ("sft.data", "x.jsonl"), ("generate.temperature", 0.1),
]
#: schedule changes that leave steps 1-2 as they were (wsd, 4 steps: decay from step 3)
EXACT_SCHEDULE = [("train.steps", 6), ("train.min_lr_ratio", 0.5), ("train.schedule", "cosine")]


@pytest.mark.parametrize("field,value", PRETRAIN_ALLOWED, ids=[f"{f}={v}" for f, v in PRETRAIN_ALLOWED])
def test_pretrain_resume_allows_a_change_that_keeps_the_run(run_copy, field, value):
    cfg, run = run_copy
    last = pretrain_stage(_set(cfg, field, value), run, resume=True, progress=False)
    assert last["step"] == 4 and last["steps_run"] == 2


@pytest.mark.parametrize("field,value", EXACT_SCHEDULE, ids=[f"{f}={v}" for f, v in EXACT_SCHEDULE])
def test_an_allowed_schedule_change_resumes_to_the_straight_run(run_copy, tmp_path, field, value, capsys):
    cfg, run = run_copy
    new = _set(cfg, field, value)
    pretrain_stage(new, run, resume=True, progress=False)
    assert "the learning rates of the 2 steps taken are unchanged" in capsys.readouterr().err
    pretrain_stage(new, tmp_path / "straight", progress=False)
    got, want = read_metrics(run), read_metrics(tmp_path / "straight")
    assert [m["step"] for m in got] == list(range(1, new.train.steps + 1))
    for key in ("loss", "lr", "grad_norm"):
        assert [m[key] for m in got] == [m[key] for m in want], key  # bit-identical
    assert len({m["lr"] for m in want}) > 1  # the schedule moves: the comparison is not vacuous


def test_schedule_check_compares_every_step_taken(tiny_run):
    cfg, _ = tiny_run
    old = with_train(cfg, steps=100, warmup_steps=10, schedule="wsd", decay_fraction=0.2)
    new = with_train(old, steps=200)  # decay of the 100-step run begins at step 80
    assert check_resume_config(old, new, "pretrain", 80, "x/config.toml")  # steps 0..79: unchanged -> a note
    with pytest.raises(CheckpointError, match=r"step 81 of the run already took"):
        check_resume_config(old, new, "pretrain", 81, "x/config.toml")


def test_accumulation_is_compared_per_global_batch(tiny_run):
    cfg, _ = tiny_run
    two = with_train(cfg, grad_accum_steps=2)
    assert check_resume_config(cfg, two, "pretrain", 2, "c", saved_world_size=2, world_size=1) == []
    with pytest.raises(CheckpointError, match=r"train\.grad_accum_steps = 1 on 1 data-parallel rank\(s\) \(the run "
                                              r"has 1 on 2; set train\.grad_accum_steps = 2"):
        check_resume_config(cfg, cfg, "pretrain", 2, "c", saved_world_size=2, world_size=1)


# -- SFT ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def half_sft(half_run, tmp_path_factory):
    """(config, SFT run folder): 4 SFT steps planned on a conversation file, stopped after step 2."""
    cfg, pre = half_run
    root = tmp_path_factory.mktemp("sft")
    (root / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations(40)), encoding="utf-8")
    cfg = replace(cfg, sft=replace(cfg.sft, init=str(pre), data=str(root / "chat.jsonl"), steps=4,
                                   micro_batch_size=2, val_examples=0, max_examples=0),
                  data=replace(cfg.data, val_fraction=0.25))
    with pytest.MonkeyPatch.context() as mp:
        sigterm_at(mp, 2)
        sft_stage(cfg, root / "run", progress=False)
    (root / "chat2.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations(30)), encoding="utf-8")
    return cfg, root / "run"


@pytest.fixture
def sft_copy(half_sft, tmp_path):
    cfg, run = half_sft
    shutil.copytree(run, tmp_path / "run")
    return cfg, tmp_path / "run"


SFT_REFUSED = [
    ("sft.micro_batch_size", 4), ("sft.grad_accum_steps", 2), ("sft.lr", 0.02), ("sft.warmup_steps", 3),
    ("sft.packing", False), ("sft.compile", True), ("sft.max_examples", 10), ("data.val_fraction", 0.5), ("data.seq_len", 32),
    ("train.seed", 7), ("train.beta2", 0.99),
]


@pytest.mark.parametrize("field,value", SFT_REFUSED, ids=[f"{f}={v}" for f, v in SFT_REFUSED])
def test_sft_resume_refuses_a_change_that_breaks_exactness(sft_copy, field, value):
    cfg, run = sft_copy
    refused(sft_stage, _set(cfg, field, value), run, rf"{re.escape(field)} = {re.escape(repr(value))}")


def test_sft_resume_names_the_sft_key_not_the_train_key(sft_copy):
    cfg, run = sft_copy
    before = tree_hash(run.parent)
    with pytest.raises(CheckpointError) as exc:
        sft_stage(_set(cfg, "sft.micro_batch_size", 4), run, resume=True, progress=False)
    assert "sft.micro_batch_size = 4 (the run has 2)" in str(exc.value)
    assert "train.micro_batch_size" not in str(exc.value)
    assert tree_hash(run.parent) == before


def test_sft_resume_refuses_other_conversations(sft_copy):
    cfg, run = sft_copy
    refused(sft_stage, _set(cfg, "sft.data", str(Path(cfg.sft.data).with_name("chat2.jsonl"))), run, r"sft\.data = ")


@pytest.mark.parametrize("field,value", [("sft.val_examples", 3), ("data.document_masking", False),
                                         ("train.zero_init", False), ("train.micro_batch_size", 8),
                                         ("sft.steps", 6)])
def test_sft_resume_allows_what_sft_does_not_read(sft_copy, field, value):
    cfg, run = sft_copy
    last = sft_stage(_set(cfg, field, value), run, resume=True, progress=False)
    assert last["step"] == (6 if field == "sft.steps" else 4)


# -- damaged optimizer.pt / rng.pt -------------------------------------------------------------------
def _edit(path: Path, fn) -> None:
    """Load a torch file, let `fn` change the object in place, save it back."""
    state = torch.load(path, weights_only=True)
    fn(state)
    torch.save(state, path)


def _edit_optimizer(run: Path, fn) -> None:
    _edit(run / "step_000002" / "optimizer.pt", fn)


def _edit_rng(run: Path, fn) -> None:
    _edit(run / "step_000002" / "rng.pt", fn)


def _replace(new: dict):
    return lambda s: (s.clear(), s.update(new))


WQ = "layers.0.attention.wq.weight"


def _adamw_state(cfg, tok, tmp: Path) -> dict:
    t = _trainer(with_train(cfg, optimizer="adamw"), tok, tmp / "adamw")
    t.train_step()
    return ckpt.gather_optimizer_state(t.raw_model, t.optimizer)


OPT_DAMAGE = [
    ("wrong-shape", lambda s: s["state"][WQ].update(momentum_buffer=torch.zeros(3, 3)),
     rf"'{WQ}' momentum_buffer has shape \(3, 3\) and dtype torch\.float32, expected shape \(32, 32\)"),
    ("wrong-dtype", lambda s: s["state"][WQ].update(momentum_buffer=s["state"][WQ]["momentum_buffer"].double()),
     rf"'{WQ}' momentum_buffer has shape \(32, 32\) and dtype torch\.float64"),
    ("missing-key", lambda s: s["state"]["tok_embeddings.weight"].pop("exp_avg_sq"),
     r"parameter 'tok_embeddings\.weight' has state keys \['exp_avg', 'step'\], the adamw update keeps"),
    ("missing-param", lambda s: s["state"].pop(WQ), rf"no optimizer state for parameter '{WQ}'"),
    ("momentum-nan", lambda s: s["state"][WQ]["momentum_buffer"].view(-1).__setitem__(0, float("nan")),
     rf"'{WQ}' momentum_buffer holds NaN or infinite values"),
    ("step-negative", lambda s: s["state"]["norm.weight"].update(step=torch.tensor(-1.0)), r"holds a negative step"),
    ("step-not-scalar", lambda s: s["state"]["norm.weight"].update(step=torch.zeros(2)),
     r"'norm\.weight' step has shape \(2,\)"),
    ("state-not-tensor", lambda s: s["state"][WQ].update(momentum_buffer=[1, 2]), r"momentum_buffer is a list"),
    ("group-momentum", lambda s: s["param_groups"][0].update(momentum=0.5),
     r"param group 0 \(muon\) has momentum = 0\.5, this run builds 0\.95"),
    ("group-key-missing", lambda s: s["param_groups"][1].pop("betas"), r"param group 1 \(adamw\) has betas = '\(missing\)'"),
    ("groups-merged", lambda s: s["param_groups"].pop(), r"holds the state of another optimizer"),
    ("not-a-state", _replace({"state": [], "param_groups": []}), r"not an lmforge optimizer state"),
]


@pytest.mark.parametrize("rid,damage,match", OPT_DAMAGE, ids=[r[0] for r in OPT_DAMAGE])
def test_damaged_optimizer_state_is_refused_before_loading(run_copy, rid, damage, match):
    cfg, run = run_copy
    _edit_optimizer(run, damage)
    refused(pretrain_stage, cfg, run, r"optimizer\.pt: .*" + match)


def test_an_adamw_state_given_to_muon_is_refused(run_copy, tiny_run, tmp_path):
    cfg, run = run_copy
    _, tok = tiny_run
    adamw = _adamw_state(cfg, tok, tmp_path)
    _edit_optimizer(run, _replace(adamw))
    refused(pretrain_stage, cfg, run, r"optimizer\.pt: holds the state of another optimizer: 2 param group\(s\) of "
                                      r"kind \[adamw, adamw\], but this run builds Muon \+ AdamW")


def test_a_muon_state_given_to_adamw_is_refused(tiny_run, tmp_path):
    cfg, tok = tiny_run
    cfg = with_train(cfg, steps=4, optimizer="adamw")
    a = _trainer(cfg, tok, tmp_path / "run")
    a.train_step()
    a.save()
    muon = _trainer(with_train(cfg, optimizer="muon"), tok, tmp_path / "m")
    muon.train_step()
    torch.save(ckpt.gather_optimizer_state(muon.raw_model, muon.optimizer), tmp_path / "run" / "step_000001" /
               "optimizer.pt")
    with pytest.raises(CheckpointError, match=r"optimizer\.pt: holds the state of another optimizer: 4 param "
                                              r"group\(s\) of kind \[muon, adamw, adamw, adamw\], but this run "
                                              r"builds AdamW"):
        _trainer(cfg, tok, tmp_path / "run").resume()


RNG_DAMAGE = [
    ("torch-short", lambda r: r["ranks"][0].update(torch=r["ranks"][0]["torch"][:100]),
     r"rank 0: the torch state is a torch\.uint8 tensor of shape \(100,\), expected a uint8 tensor of 5056 bytes"),
    ("torch-float", lambda r: r["ranks"][0].update(torch=torch.zeros(5056)), r"rank 0: the torch state is a torch\.float32"),
    ("numpy-keys", lambda r: r["ranks"][0]["numpy"].__setitem__(1, torch.zeros(10, dtype=torch.int64)),
     r"rank 0: the numpy state is not an MT19937 state"),
    ("numpy-kind", lambda r: r["ranks"][0]["numpy"].__setitem__(0, "PCG64"), r"the numpy state is not an MT19937"),
    ("python-short", lambda r: r["ranks"][0]["python"].__setitem__(1, [1, 2, 3]),
     r"rank 0: the python state is not a random\.getstate\(\) state"),
    ("python-floats", lambda r: r["ranks"][0]["python"].__setitem__(1, [0.5] * 625), r"the python state is not"),
    ("missing-numpy", lambda r: r["ranks"][0].pop("numpy"), r"rank 0: expected \{torch, cuda, numpy, python\} states"),
    ("ranks-dict", lambda r: r.update(ranks={"0": 1}), r"`ranks` is dict"),
    ("world-size", lambda r: r.update(world_size=3), r"world_size = 3 but 1 rank state\(s\)"),
    ("cuda-str", lambda r: r["ranks"][0].update(cuda="x"), r"the CUDA states are a str"),
]


@pytest.mark.parametrize("rid,damage,match", RNG_DAMAGE, ids=[r[0] for r in RNG_DAMAGE])
def test_damaged_rng_state_is_refused_before_loading(run_copy, rid, damage, match):
    cfg, run = run_copy
    _edit_rng(run, damage)
    refused(pretrain_stage, cfg, run, r"rng\.pt: .*" + match)


def test_truncated_rng_file_is_refused(run_copy):
    cfg, run = run_copy
    path = run / "step_000002" / "rng.pt"
    path.write_bytes(path.read_bytes()[:300])
    refused(pretrain_stage, cfg, run, r"rng\.pt: damaged or not an lmforge file")


# -- the command line: exit 2, one error line, nothing changed ----------------------------------------
RESUME = ("pretrain", *C, "--resume", "--out", "run", "--no-progress")
CLI_ROWS = [
    ("accum", ("--set", "train.grad_accum_steps=2"), r"train\.grad_accum_steps = 2 on 1 data-parallel rank"),
    ("mbs", ("--set", "train.micro_batch_size=2"), r"train\.micro_batch_size = 2 \(the run has 4\)"),
    ("muon-momentum", ("--set", "train.muon_momentum=0.8"), r"train\.muon_momentum = 0\.8 \(the run has 0\.95\)"),
    ("precision", ("--set", "train.precision=auto"), r"train\.precision = 'auto' \(the run has 'fp32'\)"),
    ("steps", ("--set", "train.steps=3"), r"train\.steps = 3 \(the run has 2\): step 2 of the run already took"),
    ("optimizer-shape", (), r"optimizer\.pt: 'layers\.0\.attention\.wq\.weight' momentum_buffer has shape \(1,\)"),
    ("rng-truncated", (), r"rng\.pt: damaged"),
]


@pytest.mark.parametrize("rid,sets,match", CLI_ROWS, ids=[r[0] for r in CLI_ROWS])
def test_cli_refuses_with_exit_2(project, tmp_path, monkeypatch, capsys, rid, sets, match):
    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    if rid == "optimizer-shape":
        _edit_optimizer(work / "run", lambda s: s["state"][WQ].update(momentum_buffer=torch.zeros(1)))
    if rid == "rng-truncated":
        rng = work / "run" / "step_000002" / "rng.pt"
        rng.write_bytes(rng.read_bytes()[:200])
    before = tree_hash(tmp_path)
    capsys.readouterr()
    rc = main([*RESUME[:3], *sets, *RESUME[3:]])
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert err.count("error:") == 1 and "Traceback" not in err, err[-2000:]
    assert re.search(match, err[err.index("error:"):], re.S), err[-2000:]
    assert tree_hash(tmp_path) == before
