"""The tokenizer at the Hugging Face border: what `transformers` reads from an export encodes as
lmforge trained, and a folder `transformers` re-saves (what TRL's, PEFT's and transformers' own
trainers write after training an lmforge export) comes back as the same tokenizer and contract.

- `AutoTokenizer(text)` on an export (special tokens added, as lm-evaluation-harness and vLLM
  call it) gives lmforge's document start + ids: `[bos] + encode(text)` where the contract's
  `add_bos` is true, `encode(text)` alone where it is false; for lmforge's own model and for each
  family's tokenizer (`hf_families`), where it also equals what the family's own original folder
  gives; `apply_chat_template` equals `render_chat`. `export --verify` checks the same.
- `save_pretrained` by transformers of the exported model and tokenizer, then `import-hf`: the
  same contract (`tokenizer_sha256`, `add_bos`, ids, template), so `lmforge eval` of the
  re-imported model runs on the data folder the original was trained on, with the same loss.
- `tokenizer_sha256` covers what decides ids and text, not the file's bytes: the post-processor
  and the formatting are left out, a changed merge is not; a contract of the file's sha256 (the
  hash before) still loads.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_families import TOKENIZERS, build_folder  # noqa: E402
from test_export import make_checkpoint  # noqa: E402

from lmforge.contract import CONTRACT_FILE, TOKENIZER_FILE, Contract, file_sha256, tokenizer_sha256  # noqa: E402
from lmforge.errors import ContractError  # noqa: E402
from lmforge.export import ExportError, export_hf, import_hf  # noqa: E402
from lmforge.export.hf import VERIFY_TEXTS, verify_tokenizer  # noqa: E402
from lmforge.model import load_model  # noqa: E402
from lmforge.model.io import model_state  # noqa: E402
from lmforge.tokenizer import Tokenizer  # noqa: E402

CHAT = [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "    return a + b\n"}]
TEXTS = (*VERIFY_TEXTS, "def add(a, b):\n    return a + b\n", " leading space", "Hello\n\n\nworld  ")


def assert_encodes_like(auto, tok: Tokenizer, where: str) -> None:
    start = tok.contract.document_start
    assert start == ([tok.bos_id] if tok.contract.add_bos else [])
    for text in TEXTS:
        assert auto(text)["input_ids"] == start + tok.encode(text), (where, text)
        assert auto(text, add_special_tokens=False)["input_ids"] == tok.encode(text), (where, text)
    for prompt in (False, True):
        msgs = CHAT[:1] if prompt else CHAT
        theirs = list(auto.apply_chat_template(msgs, tokenize=True, return_dict=False, add_generation_prompt=prompt))
        assert theirs == tok.render_chat(msgs, add_generation_prompt=prompt).ids, (where, prompt)


def resave(src: Path, dst: Path) -> Path:
    """What a trainer does after training: transformers loads the folder and saves it again."""
    transformers.AutoModelForCausalLM.from_pretrained(str(src)).save_pretrained(str(dst))
    transformers.AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(dst))
    return dst


# -- lmforge's own model ------------------------------------------------------------------
def test_own_export_encodes_with_the_bos_and_a_resaved_folder_evaluates_on_the_original_data(
        tmp_path, tiny_run, tiny_tokenizer, tiny_corpus):
    from lmforge.stages import eval_stage

    cfg, tok = tiny_run
    ckpt = make_checkpoint(tmp_path, tiny_corpus, tok)
    out = export_hf(ckpt, tmp_path / "hf", verify=True)
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    assert auto("def f(x):")["input_ids"][0] == tok.bos_id  # before: no BOS (the post-processor was missing)
    assert_encodes_like(auto, tok, "export")
    back = import_hf(resave(out, tmp_path / "trl"), tmp_path / "back")
    ours, _, contract, _ = load_model(ckpt)
    theirs, _, back_contract, _ = load_model(back)
    assert back_contract == contract == tok.contract
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "trl"))("x")["input_ids"][0] == tok.bos_id
    a, b = model_state(ours), model_state(theirs)
    V = contract.vocab_size  # rows past the tokenizer's vocabulary are padding (zeros after an import)
    assert a.keys() == b.keys() and all(torch.equal(a[k][:V], b[k][:V]) for k in a)
    result = eval_stage(back, cfg.data.dir)  # before: contract mismatch on tokenizer_sha256 and add_bos
    assert math.isfinite(result["loss"]) and result["loss"] > 0


def test_verify_catches_an_export_without_the_bos(tmp_path, tiny_corpus, tiny_tokenizer):
    out = export_hf(make_checkpoint(tmp_path, tiny_corpus, tiny_tokenizer), tmp_path / "hf")
    raw = json.loads((out / TOKENIZER_FILE).read_text())
    raw["post_processor"] = None
    (out / TOKENIZER_FILE).write_text(json.dumps(raw))
    with pytest.raises(ExportError, match=r"AutoTokenizer encodes .* from position 0 on, lmforge as \[1, .*add_bos = True"):
        verify_tokenizer(tiny_tokenizer, out)


# -- each family's tokenizer ----------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(TOKENIZERS))
def test_family_export_encodes_like_the_familys_own_tokenizer_and_comes_back(family, tmp_path):
    """The export reads in transformers as the family's original folder does (BOS where the family's
    tokenizer prepends one, nothing else), and as lmforge encodes. One fixture is an exception:
    transformers 5 reads any `model_type: qwen2` folder with its own Qwen2Tokenizer, which replaces
    tokenizer.json's pre-tokenizer with Qwen's split (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS);
    hf_families' qwen2 tokenizer splits as GPT-2 does (real Qwen2 folders split as Qwen's, which is
    lmforge's own split too), so there transformers disagrees with the original's own
    tokenizer.json, and `export --verify` says so (and its re-save is Qwen2Tokenizer's own, NFC-normalised
    tokenizer, which import refuses as not round-tripping text)."""
    build_folder(family, tmp_path / "hf")
    original = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    tok = Tokenizer.load(ckpt)
    rebuilt = any(original(t, add_special_tokens=False)["input_ids"] != tok.encode(t) for t in TEXTS)
    assert rebuilt == (family == "qwen2")
    out = export_hf(ckpt, tmp_path / "out", verify=not rebuilt)
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in TEXTS:  # the family's own convention: BOS where its tokenizer prepends one, nothing else
        assert auto(text)["input_ids"] == original(text)["input_ids"], (family, text)
    if rebuilt:  # and its save_pretrained writes Qwen2Tokenizer's own tokenizer.json (NFC): another tokenizer
        with pytest.raises(ExportError, match="AutoTokenizer encodes"):
            verify_tokenizer(tok, out)
        return
    assert_encodes_like(auto, tok, family)
    back = import_hf(resave(out, tmp_path / "trl"), tmp_path / "back")
    assert load_model(back)[2] == tok.contract


# -- the hash -------------------------------------------------------------------------------
def test_the_hash_covers_ids_and_text_not_the_post_processor_or_formatting(tmp_path, tiny_tokenizer):
    path = tiny_tokenizer.folder / TOKENIZER_FILE
    raw = json.loads(path.read_text())
    h = tokenizer_sha256(path)
    variants = {
        "compact": json.dumps(raw),
        "post-processor": json.dumps({**raw, "post_processor": {"type": "ByteLevel", "add_prefix_space": False,
                                                                "trim_offsets": True, "use_regex": False}}),
        "old merges spelling": json.dumps({**raw, "model": {**raw["model"],
                                                            "merges": [" ".join(m) for m in raw["model"]["merges"]]}}),
    }
    for name, text in variants.items():
        (tmp_path / "t.json").write_text(text)
        assert tokenizer_sha256(tmp_path / "t.json") == h, name
    changed = {**raw, "model": {**raw["model"], "merges": raw["model"]["merges"][:-1]}}
    (tmp_path / "t.json").write_text(json.dumps(changed))
    assert tokenizer_sha256(tmp_path / "t.json") != h
    (tmp_path / "t.json").write_text("[1, 2")
    with pytest.raises(ContractError, match="not a tokenizer.json"):
        tokenizer_sha256(tmp_path / "t.json")


def test_a_contract_with_the_files_sha256_still_loads(tmp_path, tiny_tokenizer):
    folder = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer.folder, folder)
    raw = json.loads((folder / CONTRACT_FILE).read_text())
    assert raw["tokenizer_sha256"] == tokenizer_sha256(folder / TOKENIZER_FILE)
    raw["tokenizer_sha256"] = file_sha256(folder / TOKENIZER_FILE)  # as contracts were written before
    (folder / CONTRACT_FILE).write_text(json.dumps(raw))
    assert Tokenizer.load(folder).contract == Contract(**raw)
    raw["tokenizer_sha256"] = "0" * 64
    (folder / CONTRACT_FILE).write_text(json.dumps(raw))
    with pytest.raises(ContractError, match="tokenizer_sha256"):
        Tokenizer.load(folder)
