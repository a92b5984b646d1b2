"""LoRA (lmforge.model.lora, the [lora] section, `sft` with lora.rank > 0): the acceptance
tests T1-T6 of ../shared/research/LORA-DPO.md that concern LoRA.

- T1 an injected model (B = 0) computes the base logits bit for bit;
- T2 each target (wq wk wv wo w1 w2 w3, k and v under GQA too) changes the output when its B is nonzero;
- T3 merged = unmerged forward (fp32, 1e-5), merging twice changes nothing, unmerge restores the
  base bit for bit, `merged_state` equals the in-place merge; reset_parameters never touches adapters;
- T4 one optimizer step (AdamW and Muon) changes adapter tensors only;
- T5 `adapters_disabled` gives the base logits exactly;
- T6 a LoRA SFT run resumed after SIGTERM equals the straight run bit for bit; its checkpoint
  holds the adapters only; every consumer loads it merged (load_model = base + scale B A, and
  the HF export's transformers logits equal lmforge's); a changed base is refused by load and
  by --resume, the run folder unchanged; bad [lora] configs are refused naming the field.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lmforge.config import LORA_TARGETS, Config, LoRAConfig, ModelConfig, load_config
from lmforge.errors import CheckpointError, ConfigError
from lmforge.model import Transformer, load_model, lora
from lmforge.model.io import MODEL_FILE
from lmforge.runtime import training_runtime
from lmforge.stages.sft import sft_stage
from lmforge.train.optim import build_optimizer
from test_resume import read_metrics, sigterm_at
from test_sft import many_conversations, sft_cfg, write_jsonl

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, vocab_size=100)


def tiny(tie: bool = False) -> Transformer:
    m = Transformer(replace(MODEL, tie_embeddings=tie))
    m.reset_parameters(seed=0)
    return m.eval()


def tokens(B: int = 2, T: int = 16) -> torch.Tensor:
    return torch.randint(0, MODEL.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))


def randomize_b(model: Transformer, seed: int = 2, only: str | None = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, m in lora.lora_layers(model):
            if only is None or name == only:
                m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=gen) * 0.5)


def injected(rank: int = 4, **kw) -> tuple[Transformer, Transformer]:
    base, model = tiny(), tiny()
    lora.inject(model, LoRAConfig(rank=rank, **kw))
    return base, model


# -- T1, T2 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_t1_adapters_at_init_give_the_base_logits_bit_for_bit(tie):
    base, model = tiny(tie), tiny(tie)
    lora.inject(model, LoRAConfig(rank=8))
    x = tokens()
    assert torch.equal(model(x), base(x))
    names = [n for n, _ in model.named_parameters()]
    assert "layers.0.attention.wq.weight" in names and "layers.0.attention.wq.lora_a" in names
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {n for n in names if lora.is_adapter_key(n)}
    a = model.layers[0].attention.wq.lora_a.detach()
    assert float(a.abs().max()) > 0 and float(a.abs().max()) <= 1 / MODEL.dim ** 0.5  # Kaiming-uniform(a=sqrt 5)
    assert all(float(m.lora_b.detach().abs().max()) == 0 for _, m in lora.lora_layers(model))


@pytest.mark.parametrize("target", LORA_TARGETS)
def test_t2_each_target_changes_the_output(target):
    base, model = injected()
    parent = "attention" if target in ("wq", "wk", "wv", "wo") else "feed_forward"
    randomize_b(model, only=f"layers.1.{parent}.{target}")
    x = tokens()
    diff = float((model(x) - base(x)).detach().abs().max())
    assert diff > 1e-3, target
    if target in ("wk", "wv"):  # GQA: k and v have n_kv_heads x head_dim rows, and are adapted
        assert getattr(model.layers[1].attention, target).lora_b.shape == (MODEL.n_kv_heads * MODEL.resolved_head_dim(), 4)


# -- T3, T5 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rslora", [False, True])
@torch.no_grad()  # forward values only (and no autograd warning from float() of a graph tensor)
def test_t3_merge_equals_unmerged_is_idempotent_and_unmerge_restores(rslora):
    base, model = injected(rank=4, alpha=8.0, use_rslora=rslora)
    assert model.layers[0].attention.wq.scale == (8.0 / 2 if rslora else 8.0 / 4)
    randomize_b(model)
    x = tokens()
    unmerged = model(x)
    assert float((unmerged - base(x)).abs().max()) > 1e-2
    state = lora.merged_state(model)
    assert not any(lora.is_adapter_key(k) for k in state) and set(state) == set(base.state_dict())
    lora.merge(model)
    merged = model(x)
    assert float((merged - unmerged).abs().max()) < 1e-5
    once = {k: v.clone() for k, v in model.state_dict().items()}
    lora.merge(model)  # a second merge changes nothing
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in once.items())
    assert all(torch.equal(state[k], once[k]) for k in state)  # merged_state = the in-place merge
    lora.unmerge(model)
    for k, v in base.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k  # the base, bit for bit
    assert float((model(x) - unmerged).abs().max()) == 0


def test_t5_adapters_disabled_gives_the_base_exactly_also_when_merged():
    base, model = injected()
    randomize_b(model)
    x = tokens()
    adapted = model(x)
    with lora.adapters_disabled(model):
        assert torch.equal(model(x), base(x))
    assert torch.equal(model(x), adapted)
    lora.merge(model)
    with lora.adapters_disabled(model):
        assert torch.equal(model(x), base(x))
    assert model.layers[0].attention.wq.merged


def test_reset_parameters_never_touches_adapters():
    _, model = injected()
    randomize_b(model)
    before = {k: v.clone() for k, v in model.state_dict().items() if lora.is_adapter_key(k)}
    model.reset_parameters(seed=5)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    # and the base weights drawn are those of a model without adapters
    assert torch.equal(model.layers[1].feed_forward.w2.weight, _reset(5).layers[1].feed_forward.w2.weight)


def _reset(seed: int) -> Transformer:
    m = Transformer(MODEL)
    m.reset_parameters(seed=seed)
    return m


# -- T4 -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_t4_one_step_changes_only_the_adapters(optimizer):
    _, model = injected()
    randomize_b(model)  # at B = 0 A's gradient is 0 (dL/dA = scale B^T ...): give both a gradient
    model.train()
    t = replace(Config().train, optimizer=optimizer, weight_decay=0.1, lr=1e-2)
    opt = build_optimizer(model, t, training_runtime("fp32", torch.device("cpu")))
    trained = {id(p) for g in opt.param_groups for p in g["params"]}
    assert trained == {id(p) for n, p in model.named_parameters() if lora.is_adapter_key(n)}
    if optimizer == "muon":  # adapters stay on AdamW (lmforge.train.optim.is_hidden_matrix)
        assert all(g["kind"] == "adamw" for g in opt.param_groups)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = tokens()
    model(x, targets=x, loss_mask=torch.ones_like(x, dtype=torch.bool)).backward()
    opt.step()
    after = model.state_dict()
    for k, v in before.items():
        if lora.is_adapter_key(k):
            assert not torch.equal(after[k], v), k
        else:
            assert torch.equal(after[k], v), k
    assert all(p.grad is None for n, p in model.named_parameters() if not lora.is_adapter_key(n))


# -- config -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("sets, message", [
    (["lora.targets=['wq','output']"], r"'output': the output head and the embedding are never adapted"),
    (["lora.targets=['tok_embeddings']"], r"'tok_embeddings': the output head and the embedding"),
    (["lora.targets=['wqq']"], r"'wqq', not a linear layer of the blocks.*Did you mean 'wq'"),
    (["lora.targets=[]"], r"lora.targets is empty"),
    (["lora.targets=['wq','wq']"], r"appears twice"),
    (["lora.targets='wq'"], r"lora.targets = 'wq' has type str, expected a list of texts"),
    (["lora.rank=-1"], r"lora.rank = -1"),
    (["lora.dropout=1.0"], r"lora.dropout = 1.0: expected 0.0 <= value < 1.0"),
    (["lora.alpha=0"], r"lora.alpha = 0.0"),
])
def test_bad_lora_configs_are_refused_naming_the_field(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, sets)


def test_lora_defaults_and_a_good_config():
    lo = load_config(None, ["lora.rank=16", "lora.targets=['wq','wv']"]).lora
    assert lo.rank == 16 and lo.alpha == 16.0 and lo.targets == ["wq", "wv"] and lora.lora_scale(lo) == 1.0
    assert Config().lora.rank == 0 and Config().lora.targets == list(LORA_TARGETS)


# -- T6: the stage, checkpoints, consumers --------------------------------------------------------------
def tree_hash(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def base_ckpt(init_ckpt):
    """A tiny 'pretrained' checkpoint of this test's own (conftest's `init_ckpt`; tests below change it)."""
    return init_ckpt


def lora_cfg(cfg, init, data, steps=6):
    c = sft_cfg(cfg, init, data, steps=steps, grad_accum_steps=1, lr=3e-2)
    return replace(c, lora=LoRAConfig(rank=4, alpha=8.0, dropout=0.1),
                   train=replace(c.train, checkpoint_every=0, keep_last=0))


def test_t6_lora_sft_resumes_bit_exactly_and_loads_merged(tiny_run, base_ckpt, tmp_path, monkeypatch):
    cfg, tok = tiny_run
    data = write_jsonl(tmp_path / "chat.jsonl", many_conversations(40))
    c = lora_cfg(cfg, base_ckpt, data)
    sft_stage(c, tmp_path / "straight", progress=False)
    sigterm_at(monkeypatch, 3)
    assert sft_stage(c, tmp_path / "split", progress=False)["step"] == 3
    monkeypatch.undo()
    torch.manual_seed(999)
    sft_stage(c, tmp_path / "split", resume=True, progress=False)
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert [m["step"] for m in b] == list(range(1, 7))
    assert [m["loss"] for m in a] == [m["loss"] for m in b] and a[-1]["loss"] < a[0]["loss"]
    ckpt = tmp_path / "straight" / "step_000006"
    wa, wb = load_file(str(ckpt / MODEL_FILE)), load_file(str(tmp_path / "split" / "step_000006" / MODEL_FILE))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)  # adapters bit-identical
    # the checkpoint holds the adapters only, and its base by location and hash
    assert set(wa) == {f"layers.{i}.{p}.{t}.lora_{x}" for i in range(2) for t in LORA_TARGETS for x in "ab"
                       for p in ["attention" if t in ("wq", "wk", "wv", "wo") else "feed_forward"]}
    with safe_open(str(ckpt / MODEL_FILE), "pt") as f:
        meta = f.metadata()
    assert meta[lora.BASE_PATH_KEY] == str(base_ckpt.resolve())
    assert meta[lora.BASE_SHA256_KEY] == hashlib.sha256((base_ckpt / MODEL_FILE).read_bytes()).hexdigest()
    # every consumer's loader: the base with W + scale B A, a plain model
    merged, saved, _, path = load_model(tmp_path / "straight")
    assert path == ckpt and saved.lora.rank == 4 and not lora.has_adapters(merged)
    base = load_model(base_ckpt)[0]
    scale = 8.0 / 4
    for name in ("layers.0.attention.wk", "layers.1.feed_forward.w2"):
        want = base.state_dict()[f"{name}.weight"] + scale * wa[f"{name}.lora_b"] @ wa[f"{name}.lora_a"]
        assert torch.allclose(merged.state_dict()[f"{name}.weight"], want, atol=1e-6)
        assert float(wa[f"{name}.lora_b"].abs().max()) > 0  # B trained: the comparison is not vacuous
    assert torch.equal(merged.output.weight, base.output.weight)  # the head is never adapted


def test_t6_a_changed_base_is_refused_by_load_and_resume(tiny_run, base_ckpt, tmp_path):
    cfg, tok = tiny_run
    data = write_jsonl(tmp_path / "chat.jsonl", many_conversations(40))
    c = lora_cfg(cfg, base_ckpt, data, steps=2)
    run = tmp_path / "lora"
    sft_stage(c, run, progress=False)
    weights = load_file(str(base_ckpt / MODEL_FILE))
    weights["norm.weight"] = weights["norm.weight"] + 1.0  # another base at the same place
    save_file(weights, str(base_ckpt / MODEL_FILE))
    before = tree_hash(run)
    with pytest.raises(CheckpointError, match=r"now has sha256 .*another model"):
        load_model(run)
    c3 = replace(c, sft=replace(c.sft, steps=3), train=replace(c.train, steps=3))
    with pytest.raises(CheckpointError, match=r"--resume: .* adapters were trained on a base .* another model"):
        sft_stage(c3, run, resume=True, progress=False)
    assert tree_hash(run) == before
    shutil.rmtree(base_ckpt)
    with pytest.raises(CheckpointError, match=r"has no model.safetensors any more"):
        load_model(run)
    assert tree_hash(run) == before


def test_t6_hf_export_of_a_lora_checkpoint_matches_transformers(tiny_run, base_ckpt, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from lmforge.export import export_hf

    cfg, tok = tiny_run
    data = write_jsonl(tmp_path / "chat.jsonl", many_conversations(40))
    run = tmp_path / "lora"
    sft_stage(lora_cfg(cfg, base_ckpt, data, steps=3), run, progress=False)
    out = export_hf(run, tmp_path / "hf")
    ours = load_model(run)[0]
    theirs = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    x = torch.randint(0, tok.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        a, b = ours(x), theirs(x).logits
    assert float((a - b).abs().max()) < 1e-4
    with torch.inference_mode():  # the export carries the adapters: it is not the base
        assert float((load_model(base_ckpt)[0](x) - a).abs().max()) > 1e-4


def test_pretrain_refuses_lora_from_random_weights_before_any_write(tiny_run, tmp_path):
    from lmforge.stages import pretrain_stage

    cfg, _ = tiny_run
    with pytest.raises(ConfigError, match=r"lora.rank = 4: pretraining from random weights has no base.*train.init"):
        pretrain_stage(replace(cfg, lora=LoRAConfig(rank=4)), tmp_path / "pre", progress=False)
    assert not (tmp_path / "pre").exists()


@pytest.mark.parametrize("rank", [0, 4])
def test_continued_pretraining_starts_from_train_init_and_resumes_exactly(tiny_run, base_ckpt, tmp_path, monkeypatch,
                                                                          rank):
    """`pretrain --set train.init=CKPT` (all weights, or LoRA on it): step 1's loss is the
    initial checkpoint's loss on the first batch, the run resumes bit for bit, and a LoRA run's
    checkpoints hold adapters only and load merged."""
    from lmforge.data.packing import shard_stream
    from lmforge.data.shards import Shard
    from lmforge.evaluate import batch_loss
    from lmforge.model.io import latest_checkpoint
    from lmforge.stages import pretrain_stage
    from lmforge.tokenizer import Tokenizer

    cfg, tok = tiny_run
    c = replace(cfg, train=replace(cfg.train, init=str(base_ckpt), steps=4, optimizer="adamw", lr=3e-3),
                lora=LoRAConfig(rank=rank) if rank else cfg.lora)
    before = hashlib.sha256((base_ckpt / MODEL_FILE).read_bytes()).hexdigest()
    pretrain_stage(c, tmp_path / "straight", progress=False)
    stream = shard_stream(Shard.open(cfg.data.dir, "train", tok.contract), cfg.data.seq_len,
                          cfg.train.micro_batch_size, cfg.train.seed, cfg.data.document_masking)
    b = stream.next_batch()
    with torch.no_grad():
        expected = float(batch_loss(load_model(base_ckpt)[0], b)) / b.n_supervised
    assert abs(read_metrics(tmp_path / "straight")[0]["loss"] - expected) < 1e-5
    with monkeypatch.context() as m:
        sigterm_at(m, 2)
        pretrain_stage(c, tmp_path / "resumed", progress=False)
    pretrain_stage(c, tmp_path / "resumed", resume=True, progress=False)
    a, b2 = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["loss"] for r in a] == [r["loss"] for r in b2]
    saved = load_file(str(latest_checkpoint(tmp_path / "resumed") / MODEL_FILE))
    assert all(lora.is_adapter_key(k) for k in saved) == bool(rank)
    assert not lora.has_adapters(load_model(tmp_path / "resumed")[0])  # merged at load
    assert hashlib.sha256((base_ckpt / MODEL_FILE).read_bytes()).hexdigest() == before
    with pytest.raises(ConfigError, match="train.init"):  # another init cannot continue the run
        pretrain_stage(replace(c, train=replace(c.train, init=str(tmp_path / "straight"), steps=5)),
                       tmp_path / "resumed", resume=True, progress=False)


def test_cli_lora_sft_then_every_consumer_takes_the_run(tiny_run, base_ckpt, tmp_path):
    """`lmforge sft --set lora.rank=...`, then generate, eval and export (HF and GGUF) on the
    LoRA run folder as on any other; a refused target is one `error:` line, exit 2, no folder."""
    import subprocess
    import sys

    cfg, _ = tiny_run
    data = write_jsonl(tmp_path / "chat.jsonl", many_conversations(40))
    recipe = tmp_path / "recipe.toml"
    lora_cfg(cfg, base_ckpt, data, steps=2).save(recipe)

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lmforge", *argv], capture_output=True, text=True, timeout=300)

    bad = run("sft", "--config", str(recipe), "--set", "lora.targets=['wq','output']", "--out", str(tmp_path / "x"),
              "--no-progress")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: lora.targets names 'output'")
    assert not (tmp_path / "x").exists()
    out = tmp_path / "lora"
    p = run("sft", "--config", str(recipe), "--set", "lora.rank=4", "--out", str(out), "--no-progress")
    assert p.returncode == 0, p.stderr
    assert "LoRA rank 4" in p.stderr and "trainable parameters" in p.stderr
    g = run("generate", "--checkpoint", str(out), "--prompt", "def", "--max-new-tokens", "4", "--temperature", "0")
    assert g.returncode == 0 and g.stdout.startswith("def"), g.stderr
    e = run("eval", "--checkpoint", str(out))
    assert e.returncode == 0, e.stderr
    x = run("export", "--checkpoint", str(out), "--format", "gguf", "--out", str(tmp_path / "m.gguf"))
    assert x.returncode == 0 and (tmp_path / "m.gguf").stat().st_size > 0, x.stderr
    h = run("export", "--checkpoint", str(out), "--out", str(tmp_path / "hf"), "--verify")
    assert h.returncode == 0 and (tmp_path / "hf" / "model.safetensors").is_file(), h.stderr
    merged = load_model(out)[0]
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(exported["model.layers.0.self_attn.q_proj.weight"], merged.layers[0].attention.wq.weight)


def test_peft_export_loads_in_peft_with_every_key_and_the_same_logits(tiny_run, base_ckpt, tmp_path):
    """`export --format peft` on the `--format hf` export of the base: PEFT's "missing adapter
    keys" warning is an error here (a misnamed file loads as a silent no-op), and
    transformers + peft give lmforge's merged logits within 1e-4 (fp32)."""
    import warnings

    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from lmforge.export import ExportError, export_hf, export_peft
    from lmforge.export.peft import PEFT_WEIGHTS_FILE

    cfg, tok = tiny_run
    data = write_jsonl(tmp_path / "chat.jsonl", many_conversations(40))
    run = tmp_path / "lora"
    c = lora_cfg(cfg, base_ckpt, data, steps=3)
    sft_stage(replace(c, lora=replace(c.lora, targets=["wq", "wk", "wv", "wo", "w1", "w2", "w3"], use_rslora=True)),
              run, progress=False)
    hf_base = export_hf(base_ckpt, tmp_path / "hf-base")
    adapters = export_peft(run, tmp_path / "peft")
    saved = load_file(str(adapters / PEFT_WEIGHTS_FILE))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in saved and len(saved) == 2 * 2 * 7
    x = torch.randint(0, tok.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))

    def peft_logits(folder: Path) -> torch.Tensor:
        base = AutoModelForCausalLM.from_pretrained(hf_base, torch_dtype=torch.float32)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=r"(?i).*missing.*key")
            model = peft.PeftModel.from_pretrained(base, folder).eval()
        with torch.inference_mode():
            return model(x).logits

    theirs = peft_logits(adapters)
    with torch.inference_mode():
        ours, plain = load_model(run)[0](x), load_model(base_ckpt)[0](x)
    assert float((ours - theirs).abs().max()) < 1e-4
    assert float((ours - plain).abs().max()) > 1e-3  # the adapters change the logits: the parity means something
    # the control: a file under other names makes PEFT warn, and the warning fails
    bad = tmp_path / "peft-bad"
    shutil.copytree(adapters, bad)
    save_file({k.replace("self_attn", "attn"): v for k, v in saved.items()}, str(bad / PEFT_WEIGHTS_FILE))
    with pytest.raises(UserWarning, match=r"(?i)missing"):
        peft_logits(bad)
    with pytest.raises(ExportError, match=r"not a LoRA checkpoint"):
        export_peft(base_ckpt, tmp_path / "peft-of-base")


# -- two ranks ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_lora_sft_on_two_ranks_equals_one_process(tiny_run, base_ckpt, tmp_path):
    """DDP and FSDP2 on 2 gloo ranks x accumulation 1 = 1 process x accumulation 2: the same
    losses and adapters (float tolerance), frozen base weights and all; an FSDP2 LoRA run
    stopped by SIGTERM and resumed equals the straight one bit for bit."""
    from test_distributed import run_ranks

    cfg, _ = tiny_run
    data = write_jsonl(tmp_path / "chat.jsonl", many_conversations(40))
    c = lora_cfg(cfg, base_ckpt, data, steps=3)
    c = replace(c, lora=replace(c.lora, dropout=0.0))  # dropout draws differ per rank
    jobs = [{"cfg": replace(c, train=replace(c.train, data_parallel=mode)), "out": tmp_path / mode, "stage": "sft"}
            for mode in ("ddp", "fsdp")]
    fsdp = replace(c, train=replace(c.train, data_parallel="fsdp"))  # stopped after step 1, resumed
    jobs += [{"cfg": fsdp, "out": tmp_path / "fsdp-resumed", "stage": "sft", "stop_at": 1},
             {"cfg": fsdp, "out": tmp_path / "fsdp-resumed", "stage": "sft", "resume": True}]
    run_ranks(2, jobs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sft_stage(replace(c, sft=replace(c.sft, grad_accum_steps=2)), tmp_path / "one", progress=False)
    finally:
        torch.set_num_threads(threads)
    ref = read_metrics(tmp_path / "one")
    ref_w = load_file(str(tmp_path / "one" / "step_000003" / MODEL_FILE))
    for mode in ("ddp", "fsdp"):
        got = read_metrics(tmp_path / mode)
        assert [m["supervised"] for m in got] == [m["supervised"] for m in ref]
        assert max(abs(a["loss"] - b["loss"]) for a, b in zip(got, ref)) <= 1e-5, mode
        w = load_file(str(tmp_path / mode / "step_000003" / MODEL_FILE))
        assert w.keys() == ref_w.keys() and all(lora.is_adapter_key(k) for k in w)
        assert max(float((w[k] - ref_w[k]).abs().max()) for k in w) <= 1e-5, mode
    assert ref[-1]["loss"] < ref[0]["loss"]
    # FSDP2: a run stopped and resumed (adapters loaded into shards) equals the straight one bit for bit
    assert (tmp_path / "fsdp-resumed" / "step_000001").is_dir()  # the SIGTERM checkpoint it resumed from
    assert [m["loss"] for m in read_metrics(tmp_path / "fsdp-resumed")] == [m["loss"] for m in read_metrics(tmp_path / "fsdp")]
    w = load_file(str(tmp_path / "fsdp-resumed" / "step_000003" / MODEL_FILE))
    straight = load_file(str(tmp_path / "fsdp" / "step_000003" / MODEL_FILE))
    assert all(torch.equal(w[k], straight[k]) for k in straight)


def test_the_fused_decode_step_refuses_unmerged_adapters_and_takes_merged_ones():
    """decode.py reads the weights directly: an unmerged adapter would be ignored silently."""
    _, model = injected()
    randomize_b(model)
    cache = model.new_cache(2, 8)
    x = torch.tensor([3, 5])
    with pytest.raises(ValueError, match=r"unmerged LoRA adapter"):
        model.decode_step(x, torch.zeros(2, dtype=torch.long), cache)
    lora.merge(model)
    with torch.inference_mode():
        fused = model.decode_step(x, torch.zeros(2, dtype=torch.long), model.new_cache(2, 8))
        full = model(x[:, None])[:, -1]
    assert float((fused - full).abs().max()) < 1e-4


def test_t1_also_in_train_mode_with_dropout_and_t4_first_step_gradients():
    """T1 in train mode (dropout on the adapter input: B = 0 still adds exactly 0); T4's first
    step: with B = 0, grad(A) = 0 and grad(B) != 0."""
    base, model = injected(dropout=0.5)
    base.train(), model.train()
    x = tokens()
    torch.manual_seed(0)
    assert torch.equal(model(x), base(x))
    model(x, targets=x).backward()
    for name, m in lora.lora_layers(model):
        assert float(m.lora_a.grad.abs().max()) == 0, name
        assert float(m.lora_b.grad.abs().max()) > 0, name


def test_t5_adapters_disabled_under_torch_compile():
    """A compiled model follows the flag (Dynamo guards on it), in and out of the block."""
    base, model = injected()
    randomize_b(model)
    x = tokens()
    adapted = model(x)
    compiled = torch.compile(model, backend="eager")
    assert torch.allclose(compiled(x), adapted, atol=1e-6)
    with lora.adapters_disabled(model):
        assert torch.allclose(compiled(x), base(x), atol=1e-6)
        assert not torch.allclose(compiled(x), adapted, atol=1e-3)
    assert torch.allclose(compiled(x), adapted, atol=1e-6)


def test_a_lora_checkpoint_without_its_base_record_is_refused_unchanged(tiny_run, base_ckpt, tmp_path):
    cfg, _ = tiny_run
    data = write_jsonl(tmp_path / "chat.jsonl", many_conversations(40))
    run = tmp_path / "lora"
    sft_stage(lora_cfg(cfg, base_ckpt, data, steps=1), run, progress=False)
    weights = run / "step_000001" / MODEL_FILE
    save_file(load_file(str(weights)), str(weights))  # the same adapters, the metadata gone
    before = tree_hash(run)
    with pytest.raises(CheckpointError, match=r"without the base checkpoint's location and hash"):
        load_model(run)
    assert tree_hash(run) == before
