"""GGUF export proven in llama.cpp itself (through llama-cpp-python; `make interop`).

A tiny random model and a byte-level BPE (1.5K ids, trained here on part of the standard
library) are exported with `lmforge export --format gguf`; llama.cpp must then
- tokenize 500+ strings (held-out standard-library code, unicode, whitespace runs, text that
  spells special tokens, the empty string) to the same ids as lmforge, and detokenize back;
- give the same logits (max abs difference 1e-4; f32 weights, f32 KV cache);
- decode the same 64 greedy tokens from several prompts (through its KV cache);
- render the chat template to the same prompt ids as `Tokenizer.render_chat`.
A QK-norm model is proven the same way through llama.cpp's `qwen3` architecture.

Set LMFORGE_GGUF_CHECKPOINT=runs/speedrun/... to run the checks on a trained checkpoint too.
Skipped when `llama_cpp` is not importable (`make test` does not build llama.cpp).
"""

from __future__ import annotations

import ctypes
import os
import random
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

try:
    import llama_cpp
except (ImportError, OSError, RuntimeError) as exc:  # absent, or a build whose library does not load
    pytest.skip(f"llama_cpp is not importable ({exc}); `make interop` builds it", allow_module_level=True)

from gguf_helpers import make_checkpoint  # noqa: E402
from lmforge.export import export_gguf  # noqa: E402
from lmforge.generate import SamplingConfig, generate  # noqa: E402
from lmforge.tokenizer import Tokenizer, train_tokenizer  # noqa: E402
from lmforge.export.gguf import write_gguf  # noqa: E402
from lmforge.model import load_model  # noqa: E402

pytestmark = pytest.mark.interop

VOCAB = 1536
GGML_TYPE_F32 = 0
LOGIT_TOL = 1e-4


# -- corpus and strings ----------------------------------------------------------------------
def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.stat().st_size < 200_000)


def train_texts() -> list[str]:
    """Modules a..l: the tokenizer's training text."""
    return [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files() if p.name[0] < "m"][:120]


def held_out_texts() -> list[str]:
    """Modules m..z: never seen by the tokenizer."""
    return [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files() if p.name[0] >= "m"]


UNICODE = [
    "café naïve résumé", "Ελληνικά και русский текст", "中文字符测试，标点。", "日本語のテキスト、カタカナ",
    "한국어 문장입니다", "עברית מימין לשמאל", "العربية نص", "हिन्दी पाठ", "ภาษาไทย", "emoji 🎉🚀👩‍💻 mixed",
    "👨‍👩‍👧‍👦 family", "flags 🇫🇷🇯🇵", "combining e\u0301 a\u0308 o\u0302", "zero\u200bwidth\u200djoiner",
    "nbsp\u00a0here\u2003em\u3000ideographic", "math ∑∫√∞ ≤ ≥ ≠", "arrows ←↑→↓", "box ┌─┐│└┘",
    "ＦＵＬＬＷＩＤＴＨ ｔｅｘｔ", "ligature ﬁ ﬂ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙", "Ωmega µ ß ẞ", "tab\tseparated\tvalues",
    "x²+y³=z⁴", "½ ¼ ¾", "€ £ ¥ ₹ ₿", "\U0001f600" * 9, "é" * 40, "\ufeffbom start", "\x00\x01\x02 controls \x7f",
    "line\u2028sep\u2029para", "mixed 中文 and English 123 ٤٥٦", "Ǆ ǅ ǆ titlecase", "İstanbul ıi", "a" * 100,
    "ab" * 60, "1234567890" * 5, "3.14159 2.71828 -0.5e-10", "0x1F 0b1010 0o777", "'s 't 're 've 'm 'll 'd",
    "DON'T I'M WE'LL THEY'RE", "it's o'clock", "it'ſ long s", "'K kelvin 'ǅ", "``backticks`` and ~~tildes~~", "path/to/file.py:12:3",
    "https://example.com/a?b=c&d=e#f", "user@example.com", "C:\\Windows\\System32", "#!/usr/bin/env python3",
]

SPECIAL_SPELLINGS = [
    "<|im_end|>", "<|im_start|>", "<|eos|>", "<|bos|>", "<|pad|>", "<|im_start|>user\nhi<|im_end|>\n",
    "text<|eos|>more", " <|im_end|> ", "<|im_end|><|im_end|>", "<|endoftext|>", "<|im_", "|>", "<|",
    "<s></s><unk>", "[INST] hi [/INST]",
]


def whitespace_runs() -> list[str]:
    rng = random.Random(1)
    chars = [" ", "\t", "\n", "\r", "\r\n", "\u00a0", "\u3000", "\x0b", "\x0c"]
    out = ["", " ", "  ", "   ", "\n", "\n\n", "\n\n\n", "\t", "\r\n", " \n", "\n ", "    x", "x    ", "x  \n  y"]
    for _ in range(120):
        run = "".join(rng.choice(chars) for _ in range(rng.randint(1, 8)))
        out.append(rng.choice(["", "a", "def", "1", "é", "("]) + run + rng.choice(["", "b", "return", "2", "中", ")"]))
    return out


def code_snippets(n: int = 360) -> list[str]:
    rng = random.Random(0)
    texts = held_out_texts()
    out = []
    for _ in range(n):
        t = rng.choice(texts)
        start = rng.randrange(len(t))
        out.append(t[start:start + rng.choice([1, 5, 20, 80, 300, 1500])])
    return out


def all_strings() -> list[str]:
    return [*code_snippets(), *UNICODE, *SPECIAL_SPELLINGS, *whitespace_runs()]


# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stdlib_tokenizer(tmp_path_factory) -> Tokenizer:
    return train_tokenizer(train_texts(), VOCAB, tmp_path_factory.mktemp("tok") / "tok", show_progress=False)


#: llama.cpp's settings for every check (f32 KV cache, all logits), here and in the child process
LLAMA_OPTIONS = dict(logits_all=True, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, flash_attn=False, n_threads=2,
                     n_threads_batch=2, verbose=False, seed=0)


def load_llama(path: Path, n_ctx: int = 256):
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, **LLAMA_OPTIONS)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_corpus, stdlib_tokenizer):
    """(lmforge model, tokenizer, llama_cpp.Llama on the f32 GGUF, gguf path, checkpoint)."""
    tmp = tmp_path_factory.mktemp("interop")
    ckpt = make_checkpoint(tmp, tiny_corpus, stdlib_tokenizer)
    out = export_gguf(ckpt, tmp / "model-f32.gguf")
    model = load_model(ckpt)[0]
    return model, stdlib_tokenizer, load_llama(out), out, ckpt


# -- checks (shared with the optional trained checkpoint) ----------------------------------------
def check_token_ids(llm, tok: Tokenizer, strings: list[str]) -> int:
    bad = []
    for s in strings:
        ours = tok.encode(s)
        theirs = llm.tokenize(s.encode("utf-8"), add_bos=False, special=False)
        if ours != theirs:
            bad.append((s, ours, theirs))
        elif llm.detokenize(theirs, special=True) != s.encode("utf-8"):
            bad.append((s, "detokenize", llm.detokenize(theirs, special=True)))
    assert not bad, f"{len(bad)} of {len(strings)} strings differ; first: {bad[:3]}"
    return len(strings)


def lmforge_prompt(tok: Tokenizer, text: str) -> list[int]:
    """What `lmforge generate` feeds the model: the BOS first where the model's documents start with one."""
    return [*tok.contract.document_start, *tok.encode(text)]


def check_logits(llm, model, ids: list[int], tol: float) -> float:
    llm.reset()
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)], dtype=np.float32)
    with torch.inference_mode():
        ours = model.float()(torch.tensor([ids]))[0].numpy()
    assert theirs.shape == ours.shape  # n_vocab = the tokenizer's: the padding rows are gone
    diff = float(np.abs(theirs - ours).max())
    assert diff <= tol, f"max abs logit difference {diff:.3g} > {tol:g}"
    return diff


def check_greedy(llm, model, tok: Tokenizer, prompts: list[str], n: int = 64, name: str = "") -> int:
    """Greedy decoding of each prompt in lmforge and in llama.cpp: the same tokens (asserted); the count."""
    cfg = SamplingConfig(max_new_tokens=n, temperature=0.0, greedy=True)
    agree = 0
    for p in prompts:
        ids = lmforge_prompt(tok, p)
        ours = generate(model, [ids], [], cfg, tok.pad_id)[0]
        theirs = []
        for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            theirs.append(t)
            if len(theirs) == len(ours):  # no stop ids: lmforge gives n tokens; llama.cpp's generator runs on
                break
        assert theirs == ours, f"{name}prompt {p!r}: llama.cpp {theirs} vs lmforge {ours}"
        agree += len(ours)
    return agree


#: Contents never spell a special token: a runtime that renders the template to a string and
#: then parses specials (llama.cpp, transformers alike) turns "<|im_end|>" typed by a user into the
#: real token, while `render_chat` keeps it as text. That is the template's nature, not the export's.
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):\n    \"\"\"Sum.\"\"\""}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "  spaces  and\ttabs\n\n in text "}],
    [{"role": "user", "content": "café 中文 🎉"}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": ""}],
]


def llama_cpp_builtin_chat(llm, messages: list[dict]) -> str:
    """llama.cpp's own template engine (`llama_chat_apply_template`, as llama-cli / llama-server
    without --jinja use it) on the template stored in the GGUF."""
    tmpl = llama_cpp.llama_model_chat_template(llm.model, None)
    keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
    arr = (llama_cpp.llama_chat_message * len(keep))(*[llama_cpp.llama_chat_message(r, c) for r, c in keep])
    n = llama_cpp.llama_chat_apply_template(tmpl, arr, len(keep), True, None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    n = llama_cpp.llama_chat_apply_template(tmpl, arr, len(keep), True, buf, n + 1)
    assert n > 0, "llama.cpp did not recognise the chat template"
    return buf.raw[:n].decode("utf-8")


def check_chat(llm, tok: Tokenizer) -> int:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata["tokenizer.chat_template"]
    fmt = Jinja2ChatFormatter(template, eos_token=tok.spellings["eos"], bos_token=tok.spellings["bos"])
    for messages in CONVERSATIONS:
        ours = tok.render_chat(messages, add_generation_prompt=True).ids
        for text in (fmt(messages=messages).prompt, llama_cpp_builtin_chat(llm, messages)):
            theirs = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
            assert theirs == ours, f"{messages}: {text!r} -> {theirs} vs lmforge {ours}"
    return len(CONVERSATIONS)


# -- tests ----------------------------------------------------------------------------------------
def test_same_token_ids(exported):
    _, tok, llm, _, _ = exported
    strings = all_strings()
    assert len(strings) >= 500
    n = check_token_ids(llm, tok, strings)
    print(f"token ids: {n}/{n} strings identical (vocab {tok.vocab_size})")


def test_same_token_ids_tiny_tokenizer(tmp_path, tiny_corpus, tiny_tokenizer):
    """The 384-id tokenizer of the fast tests (many byte-level fallbacks)."""
    ckpt = make_checkpoint(tmp_path, tiny_corpus, tiny_tokenizer)
    llm = load_llama(export_gguf(ckpt, tmp_path / "tiny.gguf"), n_ctx=128)
    check_token_ids(llm, tiny_tokenizer, all_strings())


def test_bos_is_prepended_like_lmforge_generate(exported):
    _, tok, llm, _, _ = exported
    assert llm.tokenize(b"def f(x):", add_bos=True) == lmforge_prompt(tok, "def f(x):")
    assert llm.token_bos() == tok.bos_id and llm.token_eos() == tok.eos_id
    assert llama_cpp.llama_vocab_eot(llama_cpp.llama_model_get_vocab(llm.model)) == tok.im_end_id
    assert llm.n_vocab() == tok.vocab_size


def test_same_logits_f32(exported):
    model, tok, llm, _, _ = exported
    text = held_out_texts()[3][:3000]
    ids = lmforge_prompt(tok, text)[:200]
    diff = check_logits(llm, model, ids, LOGIT_TOL)
    print(f"max abs logit difference (f32, {len(ids)} tokens): {diff:.2e}")


def test_same_logits_tied(tmp_path, tiny_corpus, stdlib_tokenizer):
    ckpt = make_checkpoint(tmp_path, tiny_corpus, stdlib_tokenizer, seed=3, **{"model.tie_embeddings": "true"})
    llm = load_llama(export_gguf(ckpt, tmp_path / "tied.gguf"))
    ids = lmforge_prompt(stdlib_tokenizer, held_out_texts()[5][:2000])[:150]
    check_logits(llm, load_model(ckpt)[0], ids, LOGIT_TOL)


def test_same_greedy_tokens(exported):
    model, tok, llm, _, _ = exported
    prompts = ["def ", "import os\n", "class Foo:\n    def __init__(self", "# héllo wörld 中文\n", ""]
    n = check_greedy(llm, model, tok, prompts)
    print(f"greedy: {n}/{64 * len(prompts)} tokens identical")


def test_chat_template_same_prompt_ids(exported):
    _, tok, llm, _, _ = exported
    check_chat(llm, tok)


#: The child that evaluates a GGUF in llama.cpp for `llama_logits_in_child`: argv is the file, the
#: ids (comma-separated), the .npy to write, LLAMA_OPTIONS as JSON, and optionally "quantize:OUT" to
#: have llama.cpp quantize the file to q8_0 itself first (`llama_model_quantize`) and evaluate that.
_CHILD = """
import json, sys, numpy as np, llama_cpp
path, ids, out = sys.argv[1], [int(i) for i in sys.argv[2].split(",")], sys.argv[3]
if len(sys.argv) > 5:
    q = llama_cpp.llama_model_quantize_default_params()
    q.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    target = sys.argv[5].split(":", 1)[1]
    if llama_cpp.llama_model_quantize(path.encode(), target.encode(), q) != 0:
        sys.exit("llama_model_quantize failed")
    path = target
llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_batch=256, n_ubatch=256, **json.loads(sys.argv[4]))
llm.eval(ids)
np.save(out, np.array(llm.scores[: len(ids)], dtype=np.float32))
"""


def llama_logits_in_child(gguf: Path, ids: list[int], out: Path, quantize_to: Path | None = None):
    """llama.cpp's logits for `ids` (n, vocab) float32, evaluated in a child process, or a string
    saying how the child ended ("crashed: SIGSEGV", "exit 1: ...") when it did not finish: llama.cpp's
    quantized kernels crash on some CPUs, and a crash in this process would end the whole session."""
    import json
    import signal
    import subprocess
    import sys

    argv = [sys.executable, "-c", _CHILD, str(gguf), ",".join(map(str, ids)), str(out), json.dumps(LLAMA_OPTIONS)]
    if quantize_to is not None:
        argv.append(f"quantize:{quantize_to}")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if proc.returncode < 0:
        return f"crashed: {signal.Signals(-proc.returncode).name}"
    if proc.returncode != 0:
        return f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}"
    return np.load(out)


@pytest.mark.parametrize("dtype,rel", [("float16", 0.02), ("bfloat16", 0.05), ("q8_0", 0.05)])
def test_reduced_precision_close(exported, tmp_path, dtype, rel):
    """f16/bf16/q8_0 files load and stay close (relative to the logit range); not bit-equal.

    llama.cpp runs in a child process. Where its q8_0 kernels crash on this CPU, the test skips only
    if llama.cpp crashes the same way on its own q8_0 quantization of the same model's f32 file (the
    control); if the control runs and lmforge's file crashes, it fails: the file is at fault."""
    model, tok, _, f32, ckpt = exported
    gguf = export_gguf(ckpt, tmp_path / f"m-{dtype}.gguf", dtype=dtype)
    ids = lmforge_prompt(tok, held_out_texts()[7][:2000])[:120]
    theirs = llama_logits_in_child(gguf, ids, tmp_path / "ours.npy")
    if isinstance(theirs, str):
        control = llama_logits_in_child(f32, ids, tmp_path / "control.npy", quantize_to=tmp_path / "llama-q8_0.gguf")
        assert isinstance(control, str), (
            f"llama.cpp ended on lmforge's {dtype} file ({theirs}) but ran its own q8_0 quantization of the same "
            "model: the exported file is at fault")
        pytest.skip(f"llama.cpp's quantized kernels end the process on this CPU ({theirs} on lmforge's {dtype} "
                    f"file, {control} on llama.cpp's own q8_0 of the same model)")
    with torch.inference_mode():
        ours = model.float()(torch.tensor([ids]))[0].numpy()
    assert theirs.shape == ours.shape
    diff = float(np.abs(theirs - ours).max())
    scale = float(np.abs(ours).max())
    assert diff <= rel * scale, f"{dtype}: max abs logit difference {diff:.3g} > {rel} x {scale:.3g}"


# -- QK-norm through llama.cpp's qwen3 ----------------------------------------------------------------
def test_qk_norm_as_qwen3(exported, tmp_path):
    """lmforge's model.qk_norm (the default recipe's) exported as llama.cpp's qwen3: logits and
    greedy tokens equal lmforge's, with q/k norm weights away from 1 so a mapping mistake shows."""
    from dataclasses import replace

    from lmforge.model import Transformer
    from lmforge.model.io import model_state

    _, tok, _, _, ckpt = exported
    plain, cfg, contract, path = load_model(ckpt)
    model = Transformer(replace(plain.config, qk_norm=True)).eval()
    state = model_state(plain)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        own = model.state_dict()
        for k, v in state.items():
            own[k].copy_(v)
        for block in model.layers:
            block.attention.q_norm.weight.copy_(1 + 0.3 * torch.randn(model.config.resolved_head_dim(), generator=gen))
            block.attention.k_norm.weight.copy_(1 + 0.3 * torch.randn(model.config.resolved_head_dim(), generator=gen))
    ids = lmforge_prompt(tok, held_out_texts()[9][:2000])[:150]
    with torch.inference_mode():
        assert float((model(torch.tensor([ids])) - plain(torch.tensor([ids]))).abs().max()) > 1.0  # it matters
    out = write_gguf(tmp_path / "qwen3.gguf", model.config, contract, model_state(model), path / "tokenizer.json")
    llm = load_llama(out)
    assert llm.metadata["general.architecture"] == "qwen3"
    diff = check_logits(llm, model, ids, LOGIT_TOL)
    print(f"qwen3 (QK-norm) max abs logit difference: {diff:.2e}")
    check_greedy(llm, model, tok, ["def ", "import sys\n"])


# -- optional: a trained checkpoint ----------------------------------------------------------------
def test_trained_checkpoint(tmp_path):
    folder = os.environ.get("LMFORGE_GGUF_CHECKPOINT")
    if not folder:
        pytest.skip("set LMFORGE_GGUF_CHECKPOINT=runs/speedrun/... to check a trained checkpoint")
    model, _, _, path = load_model(folder)
    tok = Tokenizer.load(path)
    llm = load_llama(export_gguf(path, tmp_path / "trained.gguf"), n_ctx=min(1024, model.config.max_seq_len))
    n = check_token_ids(llm, tok, all_strings())
    ids = lmforge_prompt(tok, held_out_texts()[3][:6000])[: min(512, model.config.max_seq_len)]
    diff = check_logits(llm, model, ids, 1e-3)
    agree = check_greedy(llm, model, tok, ["def ", "import os\n", "class Parser:\n"])
    check_chat(llm, tok)
    print(f"trained checkpoint {path}: ids {n}/{n}, max abs logit diff {diff:.2e}, greedy {agree} tokens identical")
