"""`lmforge export --format peft` of a LoRA run on an imported Gemma 3 / Gemma 2 / OLMo 2 / SmolLM3 /
Granite / Phi-3 model (MODEL-FAMILIES.md §10 item 11).

Per family (`hf_families`' tiny folder, imported with `import_hf`, then SFT with LoRA on every
target, rsLoRA on): the adapters carry the family's module names (q_proj ... down_proj, as
`peft` saves them) and `peft.PeftModel.from_pretrained` loads them, with no missing-key warning,
on the `transformers` model the user started from and on lmforge's `--format hf` export of the
base. Its logits equal lmforge's in fp32 within 1e-5, at T past the sliding window: the LoRA model
before merging against PEFT's, and the merged model against PEFT's `merge_and_unload`. The tied
head stays tied (no adapter and no saved copy of the embedding or the head). Phi-3's q, k, v
adapters are one LoRA of qkv_proj of rank 3r (w1, w3: gate_up_proj, 2r), exact through PEFT's
rank_pattern and alpha_pattern, with some parts not adapted too.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import hf_families  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from lmforge.config import LORA_TARGETS, load_config  # noqa: E402
from lmforge.export import export_hf, export_peft, import_hf  # noqa: E402
from lmforge.export.peft import PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE  # noqa: E402
from lmforge.model import load_model, lora  # noqa: E402
from lmforge.model.io import MODEL_FILE, load_weights, read_checkpoint_meta, resolve_checkpoint  # noqa: E402
from lmforge.stages.sft import sft_stage  # noqa: E402

FAMILIES = [f for f in ("gemma3", "gemma2", "olmo2", "smollm3", "granite", "phi3") if f in hf_families.TOKENIZERS]
HF_MODULES = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
#: Phi-3's modules: q, k, v fused as qkv_proj, gate and up as gate_up_proj
PHI3_MODULES = ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
CHATS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help you today?"}],
    [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "return a + b"}],
    [{"role": "user", "content": "The quick brown fox?"}, {"role": "assistant", "content": "jumps over the lazy dog."}],
]


@pytest.fixture(scope="module", params=FAMILIES)
def lora_run(request, tmp_path_factory):
    """(family, HF folder, imported checkpoint, LoRA run, tokenizer size)."""
    family = request.param
    return _lora_run(family, tmp_path_factory.mktemp(family), list(LORA_TARGETS), True)


def _lora_run(family: str, tmp: Path, targets: list[str], rslora: bool):
    """(family, HF folder, imported checkpoint, LoRA run on `targets`, tokenizer size)."""
    _, fast = hf_families.build_folder(family, tmp / "hf")
    import_hf(tmp / "hf", tmp / "ckpt")
    data = tmp / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CHATS[i % 3]}) + "\n" for i in range(12)))
    cfg = load_config(None, [
        f"sft.init={tmp / 'ckpt'}", f"sft.data={data}", f"tokenizer.dir={tmp / 'ckpt'}",
        "sft.steps=3", "sft.micro_batch_size=2", "sft.grad_accum_steps=1", "sft.warmup_steps=1", "sft.lr=2e-2",
        "sft.val_examples=0", "data.seq_len=96", "data.val_fraction=0.25", "train.precision=fp32",
        "train.optimizer=adamw", "train.checkpoint_every=0", "lora.rank=4", "lora.alpha=8.0",
        f"lora.use_rslora={str(rslora).lower()}", f"lora.targets={json.dumps(targets)}"])
    sft_stage(cfg, tmp / "sft", progress=False)
    return family, tmp / "hf", tmp / "ckpt", tmp / "sft", len(fast)


def lmforge_unmerged(ckpt: Path, run: Path):
    """lmforge's LoRA model of `run` with the adapters beside the weights (not merged)."""
    base = load_model(ckpt)[0]
    path = resolve_checkpoint(run)
    config, _ = read_checkpoint_meta(path)
    lora.inject(base, config.lora)
    load_weights(base, path / MODEL_FILE)
    return base.eval()


def peft_model(base_folder: Path, adapters: Path):
    """transformers' model of `base_folder` (fp32, eager attention) with the adapters loaded by PEFT;
    a missing-key warning (names PEFT does not expect load as a silent no-op) is an error."""
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_folder), dtype=torch.float32,
                                                             attn_implementation="eager")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r"(?i).*missing.*key")
        return peft.PeftModel.from_pretrained(base, str(adapters)).eval()


def test_peft_adapters_load_on_the_family_model_with_lmforges_logits(lora_run, tmp_path):
    family, hf_folder, ckpt, run, vocab = lora_run
    adapters = export_peft(run, tmp_path / "peft")
    saved = load_file(str(adapters / PEFT_WEIGHTS_FILE))
    config = json.loads((adapters / PEFT_CONFIG_FILE).read_text())
    model_cfg = load_model(ckpt)[0].config
    modules = PHI3_MODULES if family == "phi3" else HF_MODULES
    assert config["target_modules"] == modules and config["use_rslora"] is True and config["r"] == 4
    assert len(saved) == 2 * len(modules) * model_cfg.n_layers
    assert f"base_model.model.model.layers.0.self_attn.{modules[-1]}.lora_A.weight" in saved
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in saved
    assert not any("embed" in k or "lm_head" in k for k in saved)  # the head and embedding are never adapted
    if family == "phi3":  # rank 3r and 2r, alpha scaled by sqrt(3) and sqrt(2): the same alpha / sqrt(r)
        assert config["rank_pattern"] == {"qkv_proj": 12, "gate_up_proj": 8}
        assert config["alpha_pattern"] == pytest.approx({"qkv_proj": 8.0 * 3 ** 0.5, "gate_up_proj": 8.0 * 2 ** 0.5})
        assert saved["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"].shape == (128, 12)
    _peft_parity(family, hf_folder, ckpt, run, vocab, adapters, tmp_path)

def _peft_parity(family: str, hf_folder: Path, ckpt: Path, run: Path, vocab: int, adapters: Path, tmp_path: Path):
    """PEFT's adapters on the user's folder and on lmforge's export of the base give lmforge's logits
    (unmerged, and merged against `merge_and_unload`) within 1e-5, at T past the sliding window."""
    model_cfg = load_model(ckpt)[0].config
    T = 3 * model_cfg.sliding_window + 5 if model_cfg.sliding_window else 40  # the window slides
    x = torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ours = lmforge_unmerged(ckpt, run)(x)[..., :vocab]
        merged = load_model(run)[0](x)[..., :vocab]
        plain = load_model(ckpt)[0](x)[..., :vocab]
    assert float((ours - plain).abs().max()) > 1e-3  # the adapters change the logits: the parity means something
    exported_base = export_hf(ckpt, tmp_path / "hf-base")
    for base_folder in (hf_folder, exported_base):  # the user's own model, and lmforge's export of it
        model = peft_model(base_folder, adapters)
        inner = model.get_base_model()
        if model_cfg.tie_embeddings:
            assert inner.lm_head.weight.data_ptr() == inner.model.embed_tokens.weight.data_ptr()
        with torch.inference_mode():
            theirs = model(x).logits[..., :vocab]
        diff = float((ours - theirs).abs().max())
        assert diff < 1e-5, (family, base_folder.name, diff)
        unloaded = model.merge_and_unload()
        if model_cfg.tie_embeddings:
            assert unloaded.lm_head.weight.data_ptr() == unloaded.model.embed_tokens.weight.data_ptr()
        with torch.inference_mode():
            theirs_merged = unloaded(x).logits[..., :vocab]
        diff_merged = float((merged - theirs_merged).abs().max())
        assert diff_merged < 1e-5, (family, base_folder.name, diff_merged)
        print(f"{family} on {base_folder.name}: |lmforge - peft| {diff:.2e}, merged {diff_merged:.2e}, "
              f"adapters move the logits by {float((ours - plain).abs().max()):.2e}")


def test_phi3_adapters_of_some_parts(tmp_path):
    """LoRA on q and v (not k) and on w1 (not w3), plain scale alpha / r: qkv_proj's adapter has rank
    2r with zero rows for k, gate_up_proj's rank r with zero rows for up; PEFT gives lmforge's logits."""
    family, hf_folder, ckpt, run, vocab = _lora_run("phi3", tmp_path / "run", ["wq", "wv", "w1", "w2"], False)
    adapters = export_peft(run, tmp_path / "peft")
    config = json.loads((adapters / PEFT_CONFIG_FILE).read_text())
    assert config["target_modules"] == ["down_proj", "gate_up_proj", "qkv_proj"]
    assert config["rank_pattern"] == {"qkv_proj": 8, "gate_up_proj": 4}
    assert config["alpha_pattern"] == {"qkv_proj": 16.0, "gate_up_proj": 8.0}
    saved = load_file(str(adapters / PEFT_WEIGHTS_FILE))
    b = saved["base_model.model.model.layers.1.self_attn.qkv_proj.lora_B.weight"]
    assert b.shape == (128, 8) and not b[64:96].any() and not b[:64, 4:].any() and not b[96:, :4].any()
    assert b[:64, :4].any() and b[96:, 4:].any()
    up = saved["base_model.model.model.layers.1.mlp.gate_up_proj.lora_B.weight"]
    assert up.shape == (192, 4) and not up[96:].any() and up[:96].any()
    _peft_parity(family, hf_folder, ckpt, run, vocab, adapters, tmp_path)


def test_misnamed_adapters_fail_loudly(lora_run, tmp_path):
    """The control: adapters under another family's names (Llama-2-era `self_attn` -> `attn`) make PEFT
    warn of missing keys, and the test's loader turns that warning into a failure."""
    import shutil

    from safetensors.torch import save_file

    _, hf_folder, _, run, _ = lora_run
    adapters = export_peft(run, tmp_path / "peft")
    bad = tmp_path / "bad"
    shutil.copytree(adapters, bad)
    saved = load_file(str(adapters / PEFT_WEIGHTS_FILE))
    save_file({k.replace("self_attn", "attn"): v for k, v in saved.items()}, str(bad / PEFT_WEIGHTS_FILE))
    with pytest.raises(UserWarning, match=r"(?i)missing"):
        peft_model(hf_folder, bad)


def test_peft_names_follow_the_family_record():
    """Every family's q/k/v/o and gate/up/down names come from its `Family.hf_names`."""
    from lmforge.export.families import FAMILIES
    from lmforge.export.peft import peft_name, target_module

    for family in FAMILIES.values():
        names = dict(family.hf_names)
        fused = {part: group.name for group in family.fused for part in group.parts}  # Phi-3: the fused module's
        for t in LORA_TARGETS:
            where = "attention" if t in LORA_TARGETS[:4] else "feed_forward"
            ours = f"layers.{{i}}.{where}.{t}.weight"
            hf = names[fused.get(ours, ours)]
            if ours in fused:
                assert target_module(t, family) == hf.split(".")[-2]
                continue
            assert target_module(t, family) == hf.split(".")[-2]
            assert peft_name(f"layers.5.{where}.{t}.lora_b", family) == (
                "base_model.model." + hf.replace("{i}", "5").removesuffix(".weight") + ".lora_B.weight")
    assert sorted(target_module(t, FAMILIES["gemma3_text"]) for t in LORA_TARGETS) == HF_MODULES
