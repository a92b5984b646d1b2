"""Hugging Face export and import, proven against `transformers` (P7, ecosystem).

A tiny random lmforge model (fp32) is exported with `lmforge export`; `LlamaForCausalLM`
loads the folder and must give the same logits (1e-4 max abs), the same greedy ids, and
stop at <|im_end|> by the exported generation config; `AutoTokenizer` must encode and
render chat exactly as lmforge does; export -> import must give back the same weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmforge.contract import tokenizer_sha256
from lmforge.fileio import MARKER_FILE, OutputError
from lmforge.export import ExportError, export_hf, import_hf, map_name, require_transformers, verify_export
from lmforge.generate import SamplingConfig, generate
from lmforge.model import Transformer, resolve_model_config
from lmforge.model import load_model
from lmforge.model.io import model_state
from lmforge.train.checkpoint import save_checkpoint

transformers = pytest.importorskip("transformers")

from conftest import tiny_config  # noqa: E402


def make_checkpoint(tmp: Path, corpus: Path, tok, seed: int = 0, craft=None, **overrides) -> Path:
    """A step_000000 checkpoint of a tiny random model (dim 64, GQA 4/2 heads, rope_theta and
    norm_eps off their defaults so a mapping mistake shows). `craft(model)` edits the weights."""
    sets = {"tokenizer.dir": str(tok.folder), "model.dim": 64, "model.n_heads": 4, "model.n_kv_heads": 2,
            "model.rope_theta": 5000.0, "model.norm_eps": 1e-6, "model.max_seq_len": 128,
            "model.qk_norm": "false"}  # the Llama path; test_qk_norm_* takes the Qwen3 one
    sets.update(overrides)
    cfg = tiny_config(tmp, corpus, **sets)
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    model.reset_parameters(seed=seed)
    with torch.no_grad():  # non-trivial norms, spread logits (greedy far from ties)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
        model.output.weight.mul_(20)
    if craft is not None:
        craft(model)
    return save_checkpoint(tmp / "run", 0, model, cfg, tok.folder)


def corpus_rows(tok, corpus: Path, B: int, T: int) -> torch.Tensor:
    """(B, T) ids: the corpus's documents as [bos] text [eos], back to back (several per row)."""
    stream = []
    for p in sorted(corpus.glob("*.py")):
        stream += tok.encode_document(p.read_text())
        if len(stream) >= B * T:
            break
    assert len(stream) >= B * T
    return torch.tensor(stream[: B * T]).view(B, T)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_corpus, tiny_tokenizer):
    """(checkpoint, export folder, lmforge model, HF model)."""
    tmp = tmp_path_factory.mktemp("export")
    ckpt = make_checkpoint(tmp, tiny_corpus, tiny_tokenizer)
    out = export_hf(ckpt, tmp / "hf")
    ours = load_model(ckpt)[0]
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(out)).float().eval()
    return ckpt, out, ours, theirs


# -- the name mapping --------------------------------------------------------------------
def test_map_name_covers_both_models_both_ways(exported):
    _, _, ours, theirs = exported
    hf_names = set(theirs.state_dict())
    mapped = {map_name(n) for n in ours.state_dict()}
    assert mapped == hf_names  # lm_head included: an untied model
    for n in ours.state_dict():
        assert map_name(map_name(n), to_hf=False) == n
    assert map_name("layers.11.feed_forward.w1.weight") == "model.layers.11.mlp.gate_proj.weight"
    assert map_name("model.layers.0.self_attn.q_proj.bias", to_hf=False) == "layers.0.attention.wq.bias"  # Qwen2
    for bad in ("model.layers.0.self_attn.o_proj.bias", "layers.0.feed_forward.w1.bias", "lm_head"):
        with pytest.raises(ExportError, match="biases on q, k and v only"):
            map_name(bad, to_hf=bad.startswith("layers"))


# -- the exported folder ----------------------------------------------------------------
def test_folder_holds_the_hf_files_with_the_contracts_ids(exported, tiny_tokenizer):
    _, out, ours, _ = exported
    tok = tiny_tokenizer
    assert sorted(p.name for p in out.iterdir() if p.name != MARKER_FILE) == sorted(
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
         "README.md"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) \
        == (64, 2, 4, 2)
    assert cfg["intermediate_size"] == ours.config.resolved_ffn_dim()
    assert (cfg["rope_theta"], cfg["rms_norm_eps"], cfg["max_position_embeddings"]) == (5000.0, 1e-6, 128)
    # the tokenizer's vocab (356), not the padded embedding (384): P6 across the border
    assert cfg["vocab_size"] == tok.vocab_size == 356 and ours.model_vocab_size == 384
    assert load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"].shape == (356, 64)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (tok.bos_id, tok.eos_id, tok.pad_id)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eos_id, tok.im_end_id] and gen["pad_token_id"] == tok.pad_id
    # the tokenizer's own, with the post-processor that adds the BOS as lmforge's documents start
    exported_json = json.loads((out / "tokenizer.json").read_text())
    own = json.loads((tok.folder / "tokenizer.json").read_text())
    assert {k: v for k, v in exported_json.items() if k != "post_processor"} == \
        {k: v for k, v in own.items() if k != "post_processor"}
    assert exported_json["post_processor"]["type"] == "TemplateProcessing"
    assert tokenizer_sha256(out / "tokenizer.json") == tok.contract.tokenizer_sha256
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == tok.contract.chat_template and tc["eos_token"] == "<|eos|>"


# -- parity with transformers ------------------------------------------------------------
def test_logits_equal_llama_for_causal_lm(exported, tiny_tokenizer, tiny_corpus):
    _, _, ours, theirs = exported
    x = corpus_rows(tiny_tokenizer, tiny_corpus, B=4, T=128)  # 4 rows of several documents each
    assert int((x == tiny_tokenizer.bos_id).sum()) >= 4
    with torch.inference_mode():
        a, b = ours(x), theirs(x).logits
    assert a.shape == b.shape == (4, 128, tiny_tokenizer.vocab_size)
    assert float((a - b).abs().max()) < 1e-4
    assert float(a.std()) > 1.0  # the logits are far from constant: the comparison means something


def test_packed_documents_equal_separate_hf_forwards(exported, tiny_tokenizer, tiny_corpus):
    """lmforge's packed row (document_ids + per-document positions) equals HF run on each
    document alone: document masking and position resets match the reference."""
    _, _, ours, theirs = exported
    tok = tiny_tokenizer
    docs = [tok.encode_document(p.read_text())[:40] for p in sorted(tiny_corpus.glob("*.py"))[:3]]
    row = torch.tensor([sum(docs, [])])
    doc_ids = torch.tensor([sum(([i] * len(d) for i, d in enumerate(docs)), [])])
    pos = torch.tensor([sum((list(range(len(d))) for d in docs), [])])
    with torch.inference_mode():
        packed = ours(row, pos, doc_ids)[0]
        alone = torch.cat([theirs(torch.tensor([d])).logits[0] for d in docs])
    assert float((packed - alone).abs().max()) < 1e-4


def test_greedy_generation_equals_hf_generate(exported, tiny_tokenizer):
    """32 greedy tokens from left-padded prompts of different lengths: identical ids."""
    _, _, ours, theirs = exported
    tok = tiny_tokenizer
    prompts = [[tok.bos_id, *tok.encode(t)] for t in ("def value", "import", "class data(self):\n    return")]
    stops = [tok.eos_id, tok.im_end_id]
    out = generate(ours, prompts, stops, SamplingConfig(max_new_tokens=32, greedy=True), tok.pad_id)
    L = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_id] * (L - len(p)) + p for p in prompts])
    mask = (torch.arange(L)[None] >= torch.tensor([L - len(p) for p in prompts])[:, None]).long()
    with torch.inference_mode():
        hf = theirs.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=32)[:, L:]
    for row, ref in zip(out, hf.tolist()):
        cut = next((i + 1 for i, t in enumerate(ref) if t in stops), len(ref))  # HF pads after a stop
        assert row == ref[:cut]
    assert max(map(len, out)) == 32  # at least one row ran the full 32 tokens


def test_auto_tokenizer_encodes_and_renders_chat_like_lmforge(exported, tiny_tokenizer):
    _, out, _, _ = exported
    tok = tiny_tokenizer
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    texts = ["def value(self):\n    return None  # note", "  x = 1\n\n\ty", "für 12345 ünïcode ✓", ""]
    for text in texts:  # documents start with the BOS (the contract's add_bos), as lmforge trained
        assert auto(text, add_special_tokens=True)["input_ids"] == [tok.bos_id] + tok.encode(text)
        assert auto(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
        assert auto.decode(tok.encode(text)) == text
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "def value(self):"},
                {"role": "assistant", "content": "    return self.data\n"}]
    for gen_prompt in (False, True):
        theirs = auto.apply_chat_template(messages, tokenize=True, return_dict=False,
                                          add_generation_prompt=gen_prompt)
        assert list(theirs) == tok.render_chat(messages, add_generation_prompt=gen_prompt).ids
    assert (auto.eos_token_id, auto.bos_token_id, auto.pad_token_id) == (tok.eos_id, tok.bos_id, tok.pad_id)


def test_hf_generation_stops_at_im_end_by_the_generation_config(tmp_path, tiny_corpus, tiny_tokenizer):
    """A model crafted to say X after anything but X, and <|im_end|> after X. transformers,
    with only the exported generation_config, stops right after <|im_end|>; with <|eos|> as the
    only stop id it would run on to max_new_tokens."""
    tok = tiny_tokenizer
    X = tok.encode(" value")[0]

    def craft(m):
        v2 = torch.tensor([1.0, -1.0] * 32)  # orthogonal to the all-ones vector
        with torch.no_grad():
            for block in m.layers:  # the residual stream is the current token's embedding
                block.attention.wo.weight.zero_()
                block.feed_forward.w2.weight.zero_()
            for n, p in m.named_parameters():
                if n.endswith("norm.weight"):
                    p.fill_(1.0)
            m.tok_embeddings.weight.fill_(1.0)
            m.tok_embeddings.weight[X] = v2
            m.output.weight.zero_()
            m.output.weight[X] = 1.0
            m.output.weight[tok.im_end_id] = v2

    out = export_hf(make_checkpoint(tmp_path, tiny_corpus, tok, craft=craft), tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out)).float().eval()
    prompt = torch.tensor([[tok.bos_id, *tok.encode("def")]])
    with torch.inference_mode():
        new = hf.generate(prompt, do_sample=False, max_new_tokens=10)[0, prompt.shape[1]:].tolist()
        assert new == [X, tok.im_end_id]
        forced = hf.generate(prompt, do_sample=False, max_new_tokens=10, eos_token_id=tok.eos_id)
    assert forced.shape[1] - prompt.shape[1] == 10  # without <|im_end|> as a stop id it would not stop


# -- import, and the round trip ----------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True])
def test_export_import_round_trip_is_bit_identical(tmp_path, tiny_corpus, tiny_tokenizer, tie):
    ckpt = make_checkpoint(tmp_path, tiny_corpus, tiny_tokenizer, seed=3, **{"model.tie_embeddings": str(tie).lower()})
    first = export_hf(ckpt, tmp_path / "hf1")
    back = import_hf(first, tmp_path / "imported")
    a, a_cfg, a_contract, _ = load_model(ckpt)
    b, b_cfg, b_contract, _ = load_model(back)
    assert Transformer.from_checkpoint(back).config.tie_embeddings is tie
    assert b_contract == a_contract  # same tokenizer bytes, same ids, same template
    sa, sb = model_state(a), model_state(b)
    assert sa.keys() == sb.keys()
    V = a_contract.vocab_size
    for k in sa:
        if k in ("tok_embeddings.weight", "output.weight"):
            assert torch.equal(sa[k][:V], sb[k][:V]) and not sb[k][V:].any()  # padding rows: zeros
        else:
            assert torch.equal(sa[k], sb[k]), k
    x = torch.randint(0, V, (2, 50))
    assert torch.equal(a(x), b(x))
    assert (b_cfg.model.dim, b_cfg.model.resolved_ffn_dim(), b_cfg.model.rope_theta, b_cfg.model.norm_eps) == \
        (a_cfg.model.dim, a_cfg.model.resolved_ffn_dim(), a_cfg.model.rope_theta, a_cfg.model.norm_eps)
    second = export_hf(back, tmp_path / "hf2")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        if name == "generation_config.json":  # the imported config keeps lmforge's sampling defaults
            continue
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_import_a_folder_saved_by_transformers(tmp_path, exported, tiny_tokenizer):
    """A LlamaForCausalLM saved by save_pretrained (tied, its own config format) imports to an
    lmforge checkpoint with the same logits, which generate and from_checkpoint accept."""
    _, out, _, _ = exported
    tok = tiny_tokenizer
    cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size + 20, hidden_size=48, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                                   max_position_embeddings=96, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                   rope_theta=20000.0)
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    hf.save_pretrained(tmp_path / "hf")
    transformers.AutoTokenizer.from_pretrained(str(out)).save_pretrained(tmp_path / "hf")
    back = import_hf(tmp_path / "hf", tmp_path / "ours")
    m = Transformer.from_checkpoint(back)
    assert (m.config.dim, m.config.n_heads, m.config.n_kv_heads, m.config.ffn_dim, m.config.max_seq_len) == \
        (48, 6, 3, 96, 96)
    assert m.config.tie_embeddings and m.vocab_size == tok.vocab_size
    x = torch.randint(0, tok.vocab_size, (2, 60))
    with torch.inference_mode():
        ref = hf(x).logits[..., : tok.vocab_size]  # rows past the tokenizer's vocab are dropped
        assert float((m(x) - ref).abs().max()) < 1e-4
    assert len(generate(m, [[tok.bos_id, 5]], [], SamplingConfig(max_new_tokens=4, greedy=True), tok.pad_id)[0]) == 4


def test_import_adds_rows_for_tokens_the_tokenizer_gains(tmp_path, tiny_corpus):
    """A foreign tokenizer (EOS "</s>", no PAD, BOS or ChatML tokens) gains lmforge's tokens
    on import; their embedding rows start at the mean of the original rows, and the logits of
    the original ids are HF's."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hft = HFTok(models.BPE())
    hft.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hft.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hft.train_from_iterator([p.read_text() for p in sorted(tiny_corpus.glob("*.py"))], trainer)
    src = tmp_path / "hf"
    src.mkdir()
    hft.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "add_prefix_space": False}))
    V0 = hft.get_vocab_size(with_added_tokens=True)
    cfg = transformers.LlamaConfig(vocab_size=V0, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(2)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    hf.save_pretrained(src)
    lines = []
    back = import_hf(src, tmp_path / "ours", log=lines.append)
    m = Transformer.from_checkpoint(back)
    # no BOS of its own (none added), no chat template (ChatML's two markers added), and a pad
    assert m.vocab_size == V0 + 3 and any("mean" in line for line in lines)
    emb = m.tok_embeddings.weight
    assert torch.allclose(emb[V0:V0 + 3], hf.model.embed_tokens.weight.mean(0).expand(3, -1))
    x = torch.randint(0, V0, (1, 30))
    with torch.inference_mode():
        assert float((m(x)[..., :V0] - hf(x).logits).abs().max()) < 1e-4


def _hf_folder(tmp_path: Path, exported, name: str = "edited", **changes) -> Path:
    _, out, _, _ = exported
    dst = tmp_path / name
    dst.mkdir()
    for p in out.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "phi", "architectures": ["PhiForCausalLM"]}, "model_type = 'phi'"),
    ({"attention_bias": True}, "attention_bias = True"),
    ({"mlp_bias": True}, "mlp_bias = True"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "rope_parameters": None}, "low_freq_factor"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type = 'yarn'"),
    ({"head_dim": 32}, "head_dim = 32"),
    ({"vocab_size": 100}, "vocab_size = 100"),
])
def test_import_refuses_what_lmforge_cannot_represent(tmp_path, exported, changes, message):
    src = _hf_folder(tmp_path, exported, **changes)
    with pytest.raises(ExportError, match=message.replace("(", r"\(").replace("[", r"\[")):
        import_hf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_import_errors_name_the_problem(tmp_path, exported):
    from lmforge.errors import ContractError

    with pytest.raises(ExportError, match="no config.json"):
        import_hf(tmp_path, tmp_path / "out")
    src = _hf_folder(tmp_path, exported)
    (src / "model.safetensors").unlink()
    with pytest.raises(ExportError, match="no model.safetensors"):
        import_hf(src, tmp_path / "out")
    src2 = tmp_path / "notok"
    src2.mkdir()
    (src2 / "config.json").write_bytes((src / "config.json").read_bytes())
    with pytest.raises(ContractError, match="tokenizer.json"):
        import_hf(src2, tmp_path / "out")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="notes.txt"):
        import_hf(_hf_folder(tmp_path, exported, name="good"), busy)
    assert (busy / "notes.txt").read_text() == "mine"


def test_export_refuses_a_busy_folder_and_replaces_an_earlier_export(exported, tmp_path):
    ckpt, _, _, _ = exported
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="notes.txt"):
        export_hf(ckpt, busy)
    again = export_hf(ckpt, tmp_path / "hf")
    assert export_hf(ckpt, again) == again  # an earlier export is replaced
    with pytest.raises(ExportError, match="--dtype 'int8'"):
        export_hf(ckpt, tmp_path / "x", dtype="int8")


def test_verify_passes_and_catches_a_wrong_export(exported, tmp_path):
    ckpt, out, ours, _ = exported
    assert export_hf(ckpt, tmp_path / "v", verify=True).is_dir()
    assert verify_export(ours, out) < 1e-4
    wrong = load_model(ckpt)[0]
    with torch.no_grad():  # a half-split vs interleaved RoPE mix-up looks like this: permuted q rows
        w = wrong.layers[0].attention.wq.weight
        w.copy_(w.view(4, 2, 8, 64).transpose(1, 2).reshape(64, 64))
    with pytest.raises(ExportError, match="differ from lmforge's"):
        verify_export(wrong, out)


def test_bfloat16_export_loads_in_transformers(exported, tmp_path):
    ckpt, _, ours, _ = exported
    out = export_hf(ckpt, tmp_path / "bf16", dtype="bfloat16")
    assert load_file(str(out / "model.safetensors"))["lm_head.weight"].dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert 0 < verify_export(ours, out, tol=None)  # within 5% of the logit scale, and not fp32-exact


def test_generation_config_maps_lmforge_sampling(tiny_tokenizer):
    from lmforge.config import SamplingConfig
    from lmforge.export import generation_config

    c = tiny_tokenizer.contract
    sampled = generation_config(SamplingConfig(temperature=0.7, top_k=0, top_p=0.9), c)
    assert sampled["do_sample"] and (sampled["temperature"], sampled["top_k"], sampled["top_p"]) == (0.7, 0, 0.9)
    greedy = generation_config(SamplingConfig(temperature=0.0), c)
    assert greedy["do_sample"] is False and "temperature" not in greedy
    for g in (sampled, greedy):
        assert g["eos_token_id"] == [c.eos_id, c.im_end_id] and g["pad_token_id"] == c.pad_id
        transformers.GenerationConfig(**g).validate()  # transformers accepts it as is


def test_missing_transformers_is_explained(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)
    from lmforge.errors import LmforgeError

    with pytest.raises(LmforgeError, match=r'pip install "lmforge\[hf\]"'):
        require_transformers()


def test_cli_export_and_import(exported, tmp_path, capsys):
    from lmforge.cli import main

    ckpt, _, ours, _ = exported
    assert main(["export", "--checkpoint", str(ckpt.parent), "--out", str(tmp_path / "hf")]) == 0
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    x = torch.randint(0, ours.vocab_size, (1, 20))
    assert torch.equal(Transformer.from_checkpoint(tmp_path / "back")(x), ours(x))
    assert main(["export", "--checkpoint", str(ckpt)]) == 2
    assert "--out" in capsys.readouterr().err


def test_qk_norm_exports_as_qwen3_with_equal_logits_and_imports_back(tmp_path, tiny_corpus, tiny_tokenizer):
    ckpt = make_checkpoint(tmp_path, tiny_corpus, tiny_tokenizer, **{"model.qk_norm": "true"})
    out = export_hf(ckpt, tmp_path / "hf", verify=True)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    theirs = transformers.Qwen3ForCausalLM.from_pretrained(str(out)).float().eval()
    ours = load_model(ckpt)[0]
    x = corpus_rows(tiny_tokenizer, tiny_corpus, B=2, T=96)
    with torch.inference_mode():
        a, b = ours(x), theirs(x).logits
    assert float((a - b).abs().max()) < 1e-4 and float(a.std()) > 1.0
    back = import_hf(out, tmp_path / "back")
    again = load_model(back)[0]
    assert again.config.qk_norm
    with torch.inference_mode():
        assert torch.equal(again(x), a)


# -- the export options: one check (lmforge.export.check_export_options) -------------------------
@pytest.mark.parametrize("fmt, dtype, verify, force, message", [
    ("onnx", "float32", False, False, "--format 'onnx': expected one of hf, gguf, peft."),
    ("peft", "float32", True, False, "--format peft takes neither --verify nor --force: it writes the adapters only "
                                     "(load them with peft on the --format hf export of the base) and replaces only "
                                     "an earlier export."),
    ("gguf", "float32", True, False, "--verify compares with transformers (--format hf); for GGUF run `make interop`."),
    ("hf", "q8_0", False, False, "--dtype q8_0 is for --format gguf; a Hugging Face export is float32, bfloat16 or "
                                 "float16."),
    ("hf", "float32", False, True, "--force is for --format gguf; a Hugging Face export replaces only an earlier "
                                   "export folder, never anything else."),
    ("hf", "int8", False, False, "--dtype 'int8': --format hf writes one of float32, bfloat16, float16."),
    ("gguf", "int4", False, False, "--dtype 'int4': --format gguf writes one of float32, float16, bfloat16, q8_0."),
])
def test_export_options_are_checked_in_one_place(fmt, dtype, verify, force, message, tmp_path):
    from lmforge.export import check_export_options, export_gguf, export_peft
    from lmforge.stages import export_stage

    with pytest.raises(ExportError) as exc:
        check_export_options(fmt, dtype, verify, force)
    assert str(exc.value) == message
    # the stage and the writers refuse with that same check, before reading the checkpoint
    with pytest.raises(ExportError) as exc:
        export_stage(tmp_path / "no-checkpoint", tmp_path / "out", fmt, dtype, verify, force)
    assert str(exc.value) == message
    writer = {"hf": export_hf, "gguf": export_gguf, "peft": export_peft}.get(fmt)
    if writer is not None:
        with pytest.raises(ExportError, match="^" + re.escape(message)):
            writer(tmp_path / "no-checkpoint", tmp_path / "out", dtype=dtype, verify=verify, force=force)
    assert not (tmp_path / "out").exists()
    for dt in ("float32", "bfloat16", "float16"):
        check_export_options("hf", dt)
    for dt in ("float32", "bfloat16", "float16", "q8_0"):
        check_export_options("gguf", dt, force=True)


def test_cli_refuses_an_unknown_format_with_one_error_line(tmp_path, capsys):
    from lmforge.cli import main

    assert main(["export", "--checkpoint", str(tmp_path), "--format", "onnx", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: --format 'onnx': expected one of hf, gguf, peft."
