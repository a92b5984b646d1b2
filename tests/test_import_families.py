"""`lmforge import-hf` of the Llama family as `transformers` saves it, with no hand edits.

For each family of `hf_families` (Llama tied / untied with Llama 3.1 RoPE scaling, Mistral,
Qwen2 with q/k/v biases, Qwen3 with QK-norm): the imported checkpoint's logits equal the
`transformers` model's (1e-4, fp32), and so do the logits of its re-export; the contract
follows the model's own conventions (its document terminator, its BOS or none, its chat
template and end-of-turn token, no new embedding row but a pad). Refusals name the field.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_families import build_folder  # noqa: E402

from lmforge.contract import Contract  # noqa: E402
from lmforge.errors import ContractError  # noqa: E402
from lmforge.export import ExportError, export_hf, import_hf  # noqa: E402
from lmforge.model import load_model  # noqa: E402
from lmforge.tokenizer import Tokenizer  # noqa: E402

FAMILIES = ["smollm", "llama3", "mistral", "qwen2", "qwen3"]
#: family -> (eos, im_end, bos or None, add_bos)
CONVENTIONS = {
    "smollm": ("<|endoftext|>", "<|im_end|>", None, False),
    "llama3": ("<|end_of_text|>", "<|eot_id|>", "<|begin_of_text|>", True),
    "mistral": ("</s>", "</s>", "<s>", True),
    "qwen2": ("<|endoftext|>", "<|im_end|>", None, False),
    "qwen3": ("<|endoftext|>", "<|im_end|>", None, False),
}


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(tokens).logits


@pytest.fixture(scope="module", params=FAMILIES)
def imported(request, tmp_path_factory):
    """(family, HF model, HF tokenizer, HF folder, lmforge checkpoint, import log lines)."""
    family = request.param
    tmp = tmp_path_factory.mktemp(family)
    model, fast = build_folder(family, tmp / "hf")
    lines: list[str] = []
    import_hf(tmp / "hf", tmp / "ckpt", log=lines.append)
    return family, model, fast, tmp / "hf", tmp / "ckpt", lines


def test_logits_equal_transformers_after_import_and_after_re_export(imported, tmp_path):
    family, hf, fast, _, ckpt, _ = imported
    ours, cfg, contract, _ = load_model(ckpt)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, len(fast), (2, 40), generator=gen)
    want = hf_logits(hf, tokens)[..., : len(fast)]
    with torch.inference_mode():
        got = ours(tokens)[..., : len(fast)]
    diff = float((got - want).abs().max())
    assert diff < 1e-4, (family, diff)
    assert float(want.abs().max()) > 0.5  # logits far from zero: the comparison means something
    export_hf(ckpt, tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
    diff2 = float((hf_logits(again, tokens)[..., : len(fast)] - want).abs().max())
    assert diff2 < 1e-4, (family, diff2)
    print(f"{family}: max |logit diff| import {diff:.2e}, re-export {diff2:.2e}")


def test_contract_follows_the_models_conventions(imported):
    family, _, fast, _, ckpt, lines = imported
    eos, im_end, bos, add_bos = CONVENTIONS[family]
    tok = Tokenizer.load(ckpt)
    c = tok.contract
    assert tok.spellings["eos"] == eos and tok.spellings["im_end"] == im_end
    assert tok.spellings["bos"] == bos and c.add_bos is add_bos
    assert c.document_start == ([fast.convert_tokens_to_ids(bos)] if add_bos else [])
    # one new token at most: a pad of its own (P4), never a real token of the model
    assert c.vocab_size == len(fast) + 1 and tok.spellings["pad"] == "<|pad|>"
    assert c.pad_id == len(fast)
    assert c.chat_template == fast.chat_template
    if eos != fast.eos_token:  # the chat-turn eos_token: the terminator taken, said in one line
        assert sum(f"documents end with {eos!r}" in x for x in lines) == 1
    # what transformers and the template see stays the model's own
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert config["eos_token"] == fast.eos_token


def test_documents_start_as_the_model_starts_them(imported):
    family, _, fast, _, ckpt, _ = imported
    tok = Tokenizer.load(ckpt)
    ids = tok.encode_document("Hello, world!")
    want = fast("Hello, world!")["input_ids"]  # the model's own tokenizer, with its own specials
    assert ids[: len(want)] == want and ids[-1] == tok.eos_id and len(ids) == len(want) + 1


def test_exported_tokenizer_renders_chat_like_the_original(imported, tmp_path):
    family, _, fast, _, ckpt, _ = imported
    export_hf(ckpt, tmp_path / "out")
    again = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "How are you?"}]
    for gen in (False, True):
        a = fast.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=False)
        b = again.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=False)
        assert list(a) == list(b)
    assert again("Hello")["input_ids"] == fast("Hello")["input_ids"]  # BOS or none, as the original
    gen_cfg = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    tok = Tokenizer.load(ckpt)
    assert set(gen_cfg["eos_token_id"]) == {tok.eos_id, tok.im_end_id}


# -- refusals and stated conversions ------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama")
    build_folder("smollm", tmp / "hf")
    return tmp / "hf"


def edited(src: Path, dst: Path, **changes) -> Path:
    """A copy of `src` (files copied, not linked) with config.json keys changed (None: removed)."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def tree_hash(folder: Path) -> dict:
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "model_type = 'gemma'"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "architectures = ['LlamaForSequenceClassification']"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, "rope_type = 'yarn'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope_type = 'linear'"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ({"attention_bias": True}, "attention_bias = True"),
    ({"mlp_bias": True}, "mlp_bias = True"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"head_dim": 32}, "head_dim = 32"),
])
def test_refusals_name_the_field(tmp_path, llama_folder, changes, message):
    src = edited(llama_folder, tmp_path / "src", **changes)
    before = tree_hash(src)
    with pytest.raises(ExportError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        import_hf(src, tmp_path / "out")
    assert tree_hash(src) == before and not (tmp_path / "out").exists()


def test_mistral_sliding_window_imports_as_sliding_layers_only_when_it_slides(tmp_path):
    """A window below max_position_embeddings slides in every layer (tests/test_families_hf.py
    proves the logits); one at least as long never slides and is full attention."""
    build_folder("mistral", tmp_path / "hf")
    lines: list[str] = []
    import_hf(edited(tmp_path / "hf", tmp_path / "slides", sliding_window=128), tmp_path / "out", log=lines.append)
    model = load_model(tmp_path / "out")[0].config
    assert model.layer_types == ["sliding", "sliding"] and model.sliding_window == 128
    assert any("sliding_window = 128 < max_position_embeddings = 256" in x for x in lines)
    import_hf(edited(tmp_path / "hf", tmp_path / "wide", sliding_window=256), tmp_path / "out2")
    model = load_model(tmp_path / "out2")[0].config
    assert model.layer_types == [] and model.sliding_window == 0


@pytest.mark.parametrize("rope", [
    {"rope_parameters": None, "rope_scaling": None, "rope_theta": 5000.0},  # older transformers: plain RoPE
    {"rope_parameters": None, "rope_theta": 5000.0},  # rope_scaling missing
    {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}},  # what transformers 5 writes
    {"rope_parameters": {"rope_theta": 5000.0}},  # rope_type missing
    {"rope_parameters": None, "rope_scaling": {"type": "default"}, "rope_theta": 5000.0},
])
def test_plain_rope_spellings_import_to_the_same_model(tmp_path, llama_folder, rope):
    src = edited(llama_folder, tmp_path / "src", **{k: v for k, v in rope.items()})
    if rope.get("rope_parameters", 0) is None:  # "removed" in `edited`: drop the key entirely
        pass
    import_hf(src, tmp_path / "out")
    a, _, _, _ = load_model(tmp_path / "out")
    assert a.config.rope_theta == 5000.0 and a.config.rope_scaling == "none"


def test_empty_architectures_is_stated(tmp_path, llama_folder):
    src = edited(llama_folder, tmp_path / "src", architectures=[])
    lines: list[str] = []
    import_hf(src, tmp_path / "out", log=lines.append)
    assert any("architectures = []" in x and "LlamaForCausalLM" in x for x in lines)


def test_integer_weights_are_refused(tmp_path, llama_folder):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(llama_folder, tmp_path / "src")
    state = load_file(str(tmp_path / "src" / "model.safetensors"))
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.int8)
    save_file(state, str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    before = tree_hash(tmp_path / "src")
    with pytest.raises(ExportError, match="model.norm.weight has dtype int8"):
        import_hf(tmp_path / "src", tmp_path / "out")
    assert tree_hash(tmp_path / "src") == before and not (tmp_path / "out").exists()


def test_bfloat16_weights_are_converted_and_said(tmp_path, llama_folder):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(llama_folder, tmp_path / "src")
    state = {k: v.to(torch.bfloat16) for k, v in load_file(str(tmp_path / "src" / "model.safetensors")).items()}
    save_file(state, str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    lines: list[str] = []
    import_hf(tmp_path / "src", tmp_path / "out", log=lines.append)
    assert any("bfloat16 -> float32" in x for x in lines)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/abs.safetensors", "link.safetensors"])
def test_shard_names_are_confined_to_the_folder(tmp_path, llama_folder, shard):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(llama_folder, src)
    weights = src / "model.safetensors"
    outside = tmp_path / "outside.safetensors"
    shutil.copy(weights, outside)
    if shard == "link.safetensors":
        os.symlink(outside, src / shard)
    from safetensors.torch import load_file

    names = list(load_file(str(weights)))
    weights.unlink()
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in names}}))
    before = tree_hash(src)
    with pytest.raises(ExportError, match="leads outside the folder"):
        import_hf(src, tmp_path / "out")
    assert tree_hash(src) == before and not (tmp_path / "out").exists()


def test_sharded_weights_inside_the_folder_import(tmp_path, llama_folder):
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(llama_folder, src)
    state = load_file(str(src / "model.safetensors"))
    names = sorted(state)
    half = len(names) // 2
    save_file({n: state[n] for n in names[:half]}, str(src / "a.safetensors"), metadata={"format": "pt"})
    save_file({n: state[n] for n in names[half:]}, str(src / "b.safetensors"), metadata={"format": "pt"})
    (src / "model.safetensors").unlink()
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "a.safetensors" if i < half else "b.safetensors" for i, n in enumerate(names)}}))
    import_hf(src, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_no_terminator_is_refused_naming_the_setting_that_supplies_one(tmp_path):
    build_folder("qwen2", tmp_path / "hf")
    # rename <|endoftext|> away: the vocabulary then has no document terminator
    tj = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    for t in tj["added_tokens"]:
        if t["content"] == "<|endoftext|>":
            t["content"] = "<|fim_pad|>"
    tj["model"]["vocab"]["<|fim_pad|>"] = tj["model"]["vocab"].pop("<|endoftext|>")
    (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps(tj))
    cfg = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    cfg["pad_token"] = "<|fim_pad|>"
    for v in cfg.get("added_tokens_decoder", {}).values():
        if v["content"] == "<|endoftext|>":
            v["content"] = "<|fim_pad|>"
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(cfg))
    before = tree_hash(tmp_path / "hf")
    with pytest.raises(ContractError, match="--set tokenizer.eos_token=TOKEN"):
        import_hf(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists() and tree_hash(tmp_path / "hf") == before
    p = run_cli("import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out"))
    assert p.returncode == 2 and p.stderr.count("error:") == 1 and "--set tokenizer.eos_token" in p.stderr
    p = run_cli("import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "cli"), "--set",
                "tokenizer.eos_token=<|fim_pad|>")
    assert p.returncode == 0, p.stderr
    import_hf(tmp_path / "hf", tmp_path / "out", eos_token="<|fim_pad|>")
    assert Tokenizer.load(tmp_path / "out").spellings["eos"] == "<|fim_pad|>"


@pytest.mark.parametrize("bad", [2.0, "2", True, [2]])
def test_contract_refuses_a_non_integer_special_id(tmp_path, imported, bad):
    import shutil

    shutil.copytree(imported[4], tmp_path / "ck")
    path = tmp_path / "ck" / "contract.json"
    raw = json.loads(path.read_text())
    raw["special_tokens"]["eos"] = bad
    path.write_text(json.dumps(raw))
    with pytest.raises(ContractError, match="special token 'eos' has id"):
        Contract.load(tmp_path / "ck")


# -- every stage on an imported model ---------------------------------------------------------------
def run_cli(*args: str) -> "subprocess.CompletedProcess":
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_every_stage_runs_on_an_imported_model(tmp_path):
    """import-hf -> prepare -> eval -> generate -> chat -> sft (the model's template) -> export, by the CLI."""
    model, fast = build_folder("smollm", tmp_path / "hf")
    p = run_cli("import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"))
    assert p.returncode == 0, p.stderr
    assert "documents end with '<|endoftext|>'" in p.stderr
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"d{i}.txt").write_text(f"Hello world {i}. The quick brown fox jumps over the lazy dog.\n" * 3)
    sets = ["--set", f"tokenizer.dir={tmp_path / 'ckpt'}", "--set", f"data.source={docs}",
            "--set", "data.val_fraction=0.3", "--set", "data.seq_len=64"]
    p = run_cli("prepare", "--out", str(tmp_path / "data"), *sets)
    assert p.returncode == 0, p.stderr
    tok = Tokenizer.load(tmp_path / "ckpt")
    import numpy as np

    first = np.fromfile(tmp_path / "data" / "train.bin", dtype=tok.contract.dtype)[:3].tolist()
    assert first[0] != tok.bos_id and first[0] not in (tok.pad_id,)  # no BOS: the model has none
    p = run_cli("eval", "--checkpoint", str(tmp_path / "ckpt"), "--data", str(tmp_path / "data"))
    assert p.returncode == 0, p.stderr
    p = run_cli("generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "Hello", "--greedy",
                "--max-new-tokens", "8")
    assert p.returncode == 0, p.stderr
    # greedy generation equals transformers' on the same prompt (no BOS: the model has none)
    ids = fast("Hello")["input_ids"]
    assert ids == tok.encode_prompt("Hello")
    ref = hf_greedy(model, ids, 8, stops=(tok.eos_id,))
    ref = ref[:-1] if ref and ref[-1] == tok.eos_id else ref
    assert p.stdout[: -1] == "Hello" + fast.decode(ref)
    p = subprocess_chat(tmp_path / "ckpt")
    assert p.returncode == 0, p.stderr
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {i}"},
                                                     {"role": "assistant", "content": f"{i} fox"}]}) + "\n"
                            for i in range(16)))
    p = run_cli("sft", "--out", str(tmp_path / "sft"), "--set", f"sft.init={tmp_path / 'ckpt'}",
                "--set", f"sft.data={data}", "--set", "sft.steps=2", "--set", "sft.micro_batch_size=2",
                "--set", "data.seq_len=200", "--set", "train.precision=fp32", "--set", "train.optimizer=adamw",
                "--set", f"tokenizer.dir={tmp_path / 'ckpt'}", "--no-progress")
    assert p.returncode == 0, p.stderr
    p = run_cli("export", "--checkpoint", str(tmp_path / "sft"), "--out", str(tmp_path / "exp"), "--verify")
    assert p.returncode == 0, p.stderr
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "exp"))
    assert exported.chat_template == fast.chat_template


def subprocess_chat(ckpt: Path):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "lmforge", "chat", "--checkpoint", str(ckpt), "--greedy",
                           "--max-new-tokens", "4"], input="Hi\n/exit\n", capture_output=True, text=True, timeout=300)


def hf_greedy(hf, ids: list[int], n: int, stops=()) -> list[int]:
    """Greedy ids by full `transformers` forwards, the reference (HF's `generate` would infer an
    attention mask from a pad id, and id 0 is a real token here: Llama 3's BOS)."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(hf(torch.tensor([ids + out])).logits[0, -1].argmax()))
            if out[-1] in stops:
                break
    return out


def test_greedy_generation_equals_transformers(imported):
    """The KV-cache decode path (fused decode step: q/k/v biases, QK-norm, scaled RoPE) as HF's generate."""
    from lmforge.generate import SamplingConfig, generate

    family, hf, fast, _, ckpt, _ = imported
    ours = load_model(ckpt)[0]
    ids = fast("Hello world, the quick")["input_ids"]
    got = generate(ours, [ids], [], SamplingConfig(max_new_tokens=16, greedy=True), 0)[0]
    assert got == hf_greedy(hf, ids, 16), family


def test_serve_renders_with_the_models_template(imported):
    """`lmforge serve`'s chat route: the model's own template, its turn end as the stop token."""
    import urllib.request

    pytest.importorskip("starlette")
    from lmforge.serve import build_server
    from lmforge.loading import load_checkpoint
    from serve_harness import Running

    family, hf, fast, _, ckpt, _ = imported
    model, tok, _, _ = load_checkpoint(ckpt)
    messages = [{"role": "user", "content": "Hello there"}]
    prompt = list(fast.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))
    assert tok.render_chat(messages, add_generation_prompt=True).ids == prompt
    out = hf_greedy(hf, prompt, 8, stops=(tok.im_end_id, tok.eos_id))
    if out and out[-1] in (tok.im_end_id, tok.eos_id):
        out = out[:-1]
    run = Running(build_server(model, tok, "m", max_batch=4, max_queue=8, max_tokens=8))
    try:
        body = json.dumps({"messages": messages, "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(run.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            reply = json.loads(r.read())
    finally:
        run.stop()
    assert reply["choices"][0]["message"]["content"] == fast.decode(out), family
    assert reply["usage"]["prompt_tokens"] == len(prompt)


@pytest.mark.slow
def test_sft_dry_run_reports_the_template(tmp_path):
    build_folder("llama3", tmp_path / "hf")
    assert run_cli("import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")).returncode == 0
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {i}"},
                                                     {"role": "assistant", "content": f"{i} fox"}]}) + "\n"
                            for i in range(8)))
    p = run_cli("sft", "--dry-run", "--out", str(tmp_path / "sft"), "--set", f"sft.init={tmp_path / 'ckpt'}",
                "--set", f"sft.data={data}", "--set", "data.seq_len=64", "--set", "train.precision=fp32",
                "--set", f"tokenizer.dir={tmp_path / 'ckpt'}")
    assert p.returncode == 0, p.stderr
    assert "chat template: the model's own" in p.stderr and "'<|eot_id|>'" in p.stderr
    assert "start with '<|begin_of_text|>'" in p.stderr and "parameters" in p.stderr
    assert not (tmp_path / "sft").exists()
