"""Chat, BOS and precision for an imported Gemma model (MODEL-FAMILIES.md §10 items 9 and 10).

F9, chat and BOS, on the `hf_families` Gemma 3 and Gemma 2 tokenizer (Gemma's special tokens, <bos>
prepended by the tokenizer, Gemma 3's public chat template, which writes `{{ bos_token }}` itself):
- `[system, user, assistant]` renders id for id as `transformers`' apply_chat_template: the system
  text folded into the first user turn, the assistant's role named "model";
- exactly one BOS at the start of every sequence lmforge builds from a chat: SFT rows (padded and
  packed: each document), DPO rows, RL prompts, chat prompts (a truncated one too), while the naive
  path (tokenizing the rendered text with the tokenizer's own BOS) is shown to give two;
- the loss mask covers each model turn's content and its <end_of_turn>, nothing else;
- the contract's end of turn is <end_of_turn>, derived from the template (also where the folder's
  eos_token is <end_of_turn>), and a chat reply stops on it;
- OLMo 2's template (Tülu 3's: no BOS, replies closed by <|endoftext|>) renders as transformers does.
F10, precision: float16 compute is refused for a model with `norm_offset` != 0 (Gemma's mechanism),
by every path that runs a model (the trainer, evaluation, generation, the server's engine), with a
ConfigError naming the field and the fix; bf16 and fp32 run; a Llama-shaped model is not concerned;
lmforge's own precision policy never picks float16; float16 weights in an HF export stay allowed.
End to end: import the tiny Gemma 3 folder, run SFT with LoRA for 2 steps, the loss finite and every
row with one BOS.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_families  # noqa: E402

from lmforge.config import ModelConfig, SamplingConfig, load_config  # noqa: E402
from lmforge.data.conversations import Conversation, render_samples, sft_stream  # noqa: E402
from lmforge.data.preferences import PreferencePair, pair_batches, render_pairs  # noqa: E402
from lmforge.data.prompts import Prompt  # noqa: E402
from lmforge.errors import ConfigError, DataError  # noqa: E402
from lmforge.model import Transformer, resolve_model_config  # noqa: E402
from lmforge.runtime import CPU_FP32, Runtime, training_runtime  # noqa: E402
from lmforge.tokenizer import Tokenizer, import_tokenizer  # noqa: E402

if "gemma3" not in hf_families.TOKENIZERS:  # the fixture lands with the families' import
    pytest.skip("tests/hf_families.py has no gemma3 fixture yet", allow_module_level=True)

SYSTEM = "You are terse."
CONVS = [
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello! How can I help you today?"}],
    [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "    return a + b\n"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say 12345"},
     {"role": "assistant", "content": "12345"}, {"role": "user", "content": "The quick brown fox?"},
     {"role": "assistant", "content": "jumps over the lazy dog."}],
]


@pytest.fixture(scope="module", params=[f for f in ("gemma3", "gemma2") if f in hf_families.TOKENIZERS])
def gemma(request, tmp_path_factory):
    """(transformers' tokenizer, lmforge's imported Tokenizer, the HF folder) of a Gemma fixture."""
    tmp = tmp_path_factory.mktemp(f"{request.param}-tok")
    fast = hf_families.build_tokenizer(request.param, tmp / "hf")
    tok = import_tokenizer(tmp / "hf", tmp / "tok")
    return fast, tok, tmp / "hf"


def hf_ids(fast, messages, gen: bool = False) -> list[int]:
    return list(fast.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=False))


def prompts_of(conv):
    """Every prefix of `conv` that ends on a user turn (what a reply is generated for)."""
    return [conv[: i + 1] for i, m in enumerate(conv) if m["role"] == "user"]


# -- F9: rendering ----------------------------------------------------------------------------------
def test_chat_renders_exactly_as_transformers_with_the_system_folded_and_the_model_role(gemma):
    fast, tok, _ = gemma
    for conv in CONVS:
        assert tok.render_chat(conv).ids == hf_ids(fast, conv)
        for prompt in prompts_of(conv):
            assert tok.render_chat(prompt, add_generation_prompt=True).ids == hf_ids(fast, prompt, gen=True)
    text = tok.decode(tok.render_chat(CONVS[0]).ids)
    assert text == ("<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n"
                    "<start_of_turn>model\nHello! How can I help you today?<end_of_turn>\n")
    assert "system" not in text and "assistant" not in text  # Gemma has neither role
    with pytest.raises(DataError, match="roles must alternate"):  # the template's own refusal, quoted
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_exactly_one_bos_where_the_naive_path_gives_two(gemma):
    fast, tok, _ = gemma
    bos = tok.bos_id
    assert tok.contract.add_bos and bos == fast.convert_tokens_to_ids("<bos>")
    for conv in CONVS:
        for ids in [tok.render_chat(conv).ids] + [tok.render_chat(p, add_generation_prompt=True).ids
                                                  for p in prompts_of(conv)]:
            assert ids[0] == bos and ids.count(bos) == 1
    # the control: the template writes <bos> and the tokenizer prepends one more (the classic pitfall)
    naive = fast(fast.apply_chat_template(CONVS[0], tokenize=False))["input_ids"]
    assert naive[:2] == [bos, bos]
    assert tok.encode_document("Hello")[0] == bos and tok.encode_document("Hello").count(bos) == 1
    assert tok.encode_prompt("Hello") == fast("Hello")["input_ids"]


def test_the_loss_mask_is_each_model_turns_content_and_its_end_of_turn(gemma):
    _, tok, _ = gemma
    eot = tok.im_end_id
    for conv in CONVS:
        r = tok.render_chat(conv)
        runs, run = [], []
        for i, m in zip(r.ids, r.loss_mask):
            if m:
                run.append(i)
            elif run:
                runs.append(run)
                run = []
        assert not run  # the final "\n" after <end_of_turn> is never learned
        want = [m["content"].strip() + "<end_of_turn>" for m in conv if m["role"] == "assistant"]
        assert [tok.decode(x) for x in runs] == want
        assert all(x[-1] == eot and x.count(eot) == 1 for x in runs)


def test_the_end_of_turn_is_derived_from_the_template(gemma, tmp_path):
    fast, tok, src = gemma
    assert tok.spellings["im_end"] == "<end_of_turn>" and tok.im_end_id == fast.convert_tokens_to_ids("<end_of_turn>")
    assert tok.spellings["eos"] == "<eos>" and tok.spellings["bos"] == "<bos>"
    assert tok.spellings["im_start"] is None and tok.spellings["pad"] == "<pad>"  # Gemma's own <pad>: no new row
    # some Gemma instruction uploads name <end_of_turn> their eos_token: documents still end with <eos>
    shutil.copytree(src, tmp_path / "hf")
    cfg_path = tmp_path / "hf" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["eos_token"] = "<end_of_turn>"
    cfg_path.write_text(json.dumps(cfg))
    lines: list[str] = []
    other = import_tokenizer(tmp_path / "hf", tmp_path / "tok", log=lines.append)
    assert other.spellings["eos"] == "<eos>" and other.spellings["im_end"] == "<end_of_turn>"
    assert any("documents end with '<eos>'" in x for x in lines)
    assert other.render_chat(CONVS[0]).ids == tok.render_chat(CONVS[0]).ids


def test_a_template_that_writes_two_bos_is_refused(gemma, tmp_path):
    fast2 = hf_families.build_tokenizer("gemma3", tmp_path / "hf", template="{{ bos_token }}"
                                        + hf_families.GEMMA3_TEMPLATE)
    tok = import_tokenizer(tmp_path / "hf", tmp_path / "tok")
    assert hf_ids(fast2, CONVS[0])[:2] == [tok.bos_id] * 2  # what transformers would train on
    with pytest.raises(DataError, match=r"two BOS tokens \('<bos>' twice\).*Fix the template"):
        tok.render_chat(CONVS[0])


@pytest.mark.skipif("olmo2" not in hf_families.TOKENIZERS, reason="no olmo2 fixture")
def test_olmo2_chat_renders_as_transformers_with_its_eos_closed_replies(tmp_path):
    """OLMo 2 (Tülu 3's template): bos_token = eos_token = <|endoftext|>, written by the template and
    never prepended, so the contract has no BOS; replies end with <|endoftext|>, which is learned."""
    fast = hf_families.build_tokenizer("olmo2", tmp_path / "hf")
    tok = import_tokenizer(tmp_path / "hf", tmp_path / "tok")
    assert tok.contract.bos_id is None and not tok.contract.add_bos
    assert tok.spellings["im_end"] == tok.spellings["eos"] == "<|endoftext|>"
    for conv in CONVS:
        r = tok.render_chat(conv)
        assert r.ids == hf_ids(fast, conv)
        for prompt in prompts_of(conv):
            assert tok.render_chat(prompt, add_generation_prompt=True).ids == hf_ids(fast, prompt, gen=True)
        learned = tok.decode([i for i, m in zip(r.ids, r.loss_mask) if m])
        want = "".join(m["content"] + "<|endoftext|>" for m in conv if m["role"] == "assistant")
        # a token across the header's "\n" and the reply ("\n    " before "return") is learned: it
        # overlaps the reply (transformers' rule for the assistant mask)
        assert learned == want or (conv is CONVS[1] and learned == "\n" + want), learned


# -- F9: the rows of every stage ---------------------------------------------------------------------
def segments(tokens: torch.Tensor, positions: torch.Tensor) -> list[list[int]]:
    """The attention segments of one row (lists of input ids), split where positions restart at 0:
    each piece of a packed row, a padded row whole, padding a segment of its own when packed."""
    out: list[list[int]] = []
    for t, p in zip(tokens.tolist(), positions.tolist()):
        if p == 0:
            out.append([])
        out[-1].append(t)
    return out


def assert_one_bos_each(tok: Tokenizer, batch) -> int:
    """Every segment of every row of `batch` is padding or starts with the one BOS it holds;
    returns how many BOS the batch holds."""
    n = 0
    for row in range(batch.tokens.shape[0]):
        for seg in segments(batch.tokens[row], batch.positions[row]):
            if set(seg) == {tok.pad_id}:
                continue
            assert seg[0] == tok.bos_id and seg.count(tok.bos_id) == 1, seg
            n += 1
    return n


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_sft_rows_hold_one_bos_per_conversation(gemma, packing):
    _, tok, _ = gemma
    convs = [Conversation(tuple(c), f"c{i}", f"k{i}") for i, c in enumerate(CONVS * 3)]
    samples = render_samples(convs, tok, seq_len=200)
    assert len(samples.ids) == len(convs)
    for ids in samples.ids:
        assert ids[0] == tok.bos_id and int((ids == tok.bos_id).sum()) == 1
    stream = sft_stream(samples, 200, 2, tok.pad_id, seed=0, packing=packing, shuffle=False)
    seen = sum(assert_one_bos_each(tok, b) for b in stream.batches_once())
    assert seen == len(convs)  # every conversation once, each with its one BOS


def test_dpo_rows_hold_one_bos_per_side(gemma):
    _, tok, _ = gemma
    pairs = [PreferencePair(tuple(CONVS[0][:2]), "Hello! Ask away.", "What?", "p0", "k0"),
             PreferencePair(tuple(CONVS[2][:4]), "It jumps.", "No idea.", "p1", "k1")]
    samples = render_pairs(pairs, tok, seq_len=200)
    for side in ("chosen", "rejected"):
        for ids in samples.ids[side]:
            assert ids[0] == tok.bos_id and int((ids == tok.bos_id).sum()) == 1
    for packing in (True, False):
        seen = sum(assert_one_bos_each(tok, b) for b in pair_batches(samples, 200, 2, tok.pad_id, packing=packing))
        assert seen == 2 * len(pairs)


def test_rl_and_chat_prompts_hold_one_bos_also_when_truncated(gemma):
    from lmforge.stages.generate import chat_prompt
    from lmforge.stages.rl import render_prompts

    fast, tok, _ = gemma
    prompts = [Prompt(p, f"f:{i}", f"k{i}") for i, conv in enumerate(CONVS) for p in prompts_of(conv)]
    kept, ids, dropped = render_prompts(prompts, tok, budget=200, from_file=True)
    assert dropped == 0 and len(ids) == len(prompts)
    for p, x in zip(kept, ids):
        assert x == hf_ids(fast, p.messages, gen=True) and x[0] == tok.bos_id and x.count(tok.bos_id) == 1
    history = CONVS[2][:4]
    full = chat_prompt(tok, history, budget=1000)
    assert full == hf_ids(fast, history, gen=True)
    # a budget below the whole chat: the oldest exchange goes, then what is left is cut behind the BOS
    short = chat_prompt(tok, [{"role": "user", "content": "The quick brown fox " * 8}], budget=12)
    assert len(short) == 12 and short[0] == tok.bos_id and short.count(tok.bos_id) == 1
    assert short[1:] == hf_ids(fast, [{"role": "user", "content": "The quick brown fox " * 8}], gen=True)[-11:]
    assert tok.fit_prompt(full, len(full)) == full  # nothing cut when it fits


def gemma_model(tok: Tokenizer, seed: int = 0, **changes) -> Transformer:
    """A small Gemma-3-shaped lmforge model on `tok`'s contract (random weights, norms around 0)."""
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=96, max_seq_len=128,
                      tie_embeddings=True, qk_norm=True, norm_offset=1.0, norm_placement="sandwich",
                      mlp_activation="gelu_tanh", embed_scale=8.0, layer_types=["sliding", "full"],
                      sliding_window=6, rope_theta_sliding=1e4, norm_eps=1e-6)
    model = Transformer(resolve_model_config(replace(cfg, **changes), tok.contract))
    model.reset_parameters(seed=seed)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def test_a_chat_reply_stops_on_end_of_turn(gemma):
    """The model is made to say <end_of_turn> third: the head's row of <end_of_turn> is swapped with
    the token it says third (an untied head, so the prompt's <end_of_turn> reads the same), so the
    reply is exactly its first two tokens."""
    from lmforge.generate import generate
    from lmforge.stages.generate import chat_prompt, chat_reply

    _, tok, _ = gemma
    model = gemma_model(tok, seed=3, tie_embeddings=False)
    messages = CONVS[0][:2]
    prompt = chat_prompt(tok, messages, 100)
    free = generate(model, [prompt], [], SamplingConfig(max_new_tokens=6, greedy=True), tok.pad_id)[0]
    third = free[2]
    assert tok.im_end_id not in free[:3] and third not in prompt + free[:2] and third != tok.eos_id
    with torch.no_grad():
        w = model.output.weight
        w[[third, tok.im_end_id]] = w[[tok.im_end_id, third]]
    said = generate(model, [prompt], [tok.im_end_id, tok.eos_id], SamplingConfig(max_new_tokens=6, greedy=True),
                    tok.pad_id)[0]
    assert said == free[:2] + [tok.im_end_id]
    reply = chat_reply(model, tok, messages, SamplingConfig(max_new_tokens=6, greedy=True))
    assert reply == tok.decode(free[:2])


# -- F10: no float16 compute for (offset + w) norms ------------------------------------------------------
CPU_FP16 = Runtime(torch.device("cpu"), torch.float16)
CPU_BF16 = Runtime(torch.device("cpu"), torch.bfloat16)


def test_float16_compute_is_refused_for_an_offset_norm_model_naming_the_field_and_the_fix(gemma):
    from lmforge.data.packing import Batch
    from lmforge.evaluate import evaluate_batches
    from lmforge.generate import generate

    _, tok, _ = gemma
    model = gemma_model(tok)
    with pytest.raises(ConfigError) as exc:
        CPU_FP16.check_model(model)
    msg = str(exc.value)
    for needle in ("model.norm_offset = 1", "float16", "train.precision", '"bf16"', '"fp32"', "--dtype float16"):
        assert needle in msg, needle
    greedy = SamplingConfig(max_new_tokens=2, greedy=True)
    with pytest.raises(ConfigError, match="model.norm_offset = 1"):
        generate(model, [[tok.bos_id, 7]], [], greedy, tok.pad_id, runtime=CPU_FP16)
    from lmforge.config import Config
    from lmforge.serve.engine import Engine
    from lmforge.train.trainer import Trainer

    with pytest.raises(ConfigError, match="model.norm_offset = 1"):  # before the run folder or the data is used
        Trainer(cfg=Config(), run_dir=Path("/nonexistent"), contract_dir=Path("/nonexistent"), model=model,
                stream=None, runtime=CPU_FP16)
    with pytest.raises(ConfigError, match="model.norm_offset = 1"):
        Engine(model, tok, runtime=CPU_FP16)
    Engine(model, tok, runtime=CPU_BF16)  # bf16 (and fp32, the default on a CPU) serve
    x = torch.tensor([[tok.bos_id, 7, 8, 9]])
    batch = Batch(x, x, torch.ones_like(x, dtype=torch.bool), torch.zeros_like(x), torch.arange(4)[None])
    with pytest.raises(ConfigError, match="model.norm_offset = 1"):
        evaluate_batches(model, [batch], CPU_FP16)
    # float16 weights compute in float16 without any autocast: refused too, naming a weight
    half = gemma_model(tok).half()
    with pytest.raises(ConfigError, match=r"the model's weights \(tok_embeddings.weight is float16"):
        generate(half, [[tok.bos_id, 7]], [], greedy, tok.pad_id, runtime=CPU_FP32)
    # bf16 and fp32 run; a model without the offset is not concerned
    for rt in (CPU_FP32, CPU_BF16):
        assert len(generate(model, [[tok.bos_id, 7]], [], greedy, tok.pad_id, runtime=rt)[0]) == 2
        nats, n = evaluate_batches(model, [batch], rt)
        assert np.isfinite(nats) and n == 4
    CPU_FP16.check_model(gemma_model(tok, norm_offset=0.0))


def test_lmforge_never_chooses_float16_compute(monkeypatch):
    with pytest.raises(ConfigError, match=r"train.precision = 'fp16' is not one of 'auto', 'bf16', 'fp32'.*'bf16'"):
        load_config(None, ["model.norm_offset=1.0", "train.precision=fp16"])
    import lmforge.runtime as rt

    monkeypatch.setattr(rt, "bf16_supported", lambda device: False)  # a GPU without bf16 units (a V100)
    for precision in ("auto", "bf16", "fp32"):
        for device in ("cpu", "cuda"):
            assert training_runtime(precision, device).dtype in (None, torch.bfloat16)
    assert training_runtime("auto", "cuda").dtype is None  # fp32, never float16
    assert rt.decode_runtime("cpu").dtype is None


# -- end to end: import, SFT with LoRA, export --------------------------------------------------------
def _import_gemma(tmp: Path):
    from lmforge.export import ExportError, import_hf

    model, fast = hf_families.build_folder("gemma3", tmp / "hf")
    try:
        import_hf(tmp / "hf", tmp / "ckpt")
    except ExportError as exc:
        if "gemma" in str(exc).lower():
            pytest.skip(f"import-hf does not take Gemma 3 yet: {exc}")
        raise
    return model, fast


def test_sft_with_lora_on_an_imported_gemma(tmp_path, monkeypatch):
    """import-hf of the tiny Gemma 3 folder, then 2 LoRA SFT steps on its own template: the loss is
    finite, every rendered row has one BOS, and the run exports float16 weights (compute refused, not
    storage) with both stop ids in generation_config.json."""
    import lmforge.stages.sft as sft_mod
    from lmforge.export import export_hf
    from lmforge.stages.sft import sft_stage

    _import_gemma(tmp_path)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CONVS[i % 3]}) + "\n" for i in range(12)))
    rendered = []
    real = sft_mod.render_samples

    def recording(convs, tokenizer, seq_len):
        out = real(convs, tokenizer, seq_len)
        rendered.append((out, tokenizer.bos_id))
        return out

    monkeypatch.setattr(sft_mod, "render_samples", recording)
    cfg = load_config(None, [
        f"sft.init={tmp_path / 'ckpt'}", f"sft.data={data}", f"tokenizer.dir={tmp_path / 'ckpt'}",
        "sft.steps=2", "sft.micro_batch_size=2", "sft.grad_accum_steps=1", "sft.warmup_steps=1", "sft.lr=1e-2",
        "sft.val_examples=0", "data.seq_len=96", "data.val_fraction=0.25", "train.precision=fp32",
        "train.optimizer=adamw", "train.checkpoint_every=0", "lora.rank=4", "lora.alpha=8.0"])
    last = sft_stage(cfg, tmp_path / "sft", progress=False)
    rows = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
    assert np.isfinite(last["loss"])
    assert rendered and sum(len(s.ids) for s, _ in rendered) == 12
    for samples, bos in rendered:
        for ids in samples.ids:
            assert ids[0] == bos and int((ids == bos).sum()) == 1
    export_hf(tmp_path / "sft", tmp_path / "f16", dtype="float16")  # float16 storage stays allowed
    assert json.loads((tmp_path / "f16" / "config.json").read_text())["model_type"] == "gemma3_text"
    # transformers' generate stops where lmforge's does: on <end_of_turn> and on <eos>
    tok = Tokenizer.load(tmp_path / "ckpt")
    gen_cfg = json.loads((tmp_path / "f16" / "generation_config.json").read_text())
    assert set(gen_cfg["eos_token_id"]) == {tok.im_end_id, tok.eos_id}
    assert tok.spellings["im_end"] == "<end_of_turn>"
