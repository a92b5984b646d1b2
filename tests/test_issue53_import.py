"""Issue 53's bad-input hunt on the way in (`lmforge import-hf`, `lmforge import-gguf`) and on the
[model] mechanisms they set: every folder is one `transformers` saves (tests/hf_families.py), every
GGUF one lmforge exports from such a folder, edited with gguf-py where the defect needs a bad key.

- Mistral with a sliding window and Llama 3.1 RoPE scaling: the sliding layers rotate as the full
  ones (scaled), as transformers computes; `export --verify` passes;
- a gpt2-style GGUF vocabulary without merges, and a float key written as a string, are refused
  naming the key;
- the rotary tables: the estimate counts the sliding layers' own tables, the tables are built
  without float64 temporaries of their size, and memory refused while building them is a
  ConfigError;
- config.json: head_dim 0, a string tie_word_embeddings, a sliding RoPE base <= 1 and values out
  of lmforge's range are refused under the key the file has;
- errors name the user's own file and flag, never a temporary folder or import-tokenizer's --from;
- model.sliding_window (and rope_theta_sliding) without a sliding layer is refused by validation.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_families import build_folder  # noqa: E402

from lmforge.config import Config, ModelConfig, validate  # noqa: E402
from lmforge.errors import ConfigError, LmforgeError  # noqa: E402
from lmforge.export import ExportError, export_gguf, export_hf, import_gguf, import_hf  # noqa: E402
from lmforge.model import load_model  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
REPO = Path(__file__).resolve().parents[1]


def edited(src: Path, dst: Path, **changes) -> Path:
    """A copy of the transformers-saved folder `src` with config.json keys changed."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gemma3") / "hf"
    build_folder("gemma3", folder)
    return folder


# -- 1: Mistral's sliding window with Llama 3.1 RoPE scaling ----------------------------------------
def test_mistral_sliding_window_with_llama3_rope_equals_transformers(tmp_path):
    """Every Mistral layer has the same (scaled) RoPE: the sliding layers are not rotated with an
    unscaled table of their own (Gemma 3's rule), and the exported folder verifies."""
    hf, fast = build_folder("mistral_sliding", tmp_path / "hf", rope_parameters=dict(LLAMA3_ROPE))
    assert hf.config.sliding_window == 6 and hf.config.rope_parameters["rope_type"] == "llama3"
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    ours = load_model(tmp_path / "ckpt")[0]
    assert ours.config.layer_types == ["sliding", "sliding"] and ours.config.rope_scaling == "llama3"
    tokens = torch.randint(0, len(fast), (2, 3 * 6 + 5), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = hf(tokens).logits[..., : len(fast)]
        got = ours(tokens)[..., : len(fast)]
    assert float((got - want).abs().max()) <= 1e-5
    assert float(want.abs().max()) > 0.5
    export_hf(tmp_path / "ckpt", tmp_path / "out", verify=True)  # transformers' logits within 1e-4


def test_gemma3_sliding_layers_keep_their_own_unscaled_base():
    """The rule for a sliding layer with its own base (rope_theta_sliding) is Gemma 3's, unchanged:
    its table is rope_tables(rope_theta_sliding), never scaled; without one it shares the full
    layers' table."""
    from lmforge.model import Transformer
    from lmforge.model.transformer import rope_tables

    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=64, qk_norm=False,
                layer_types=["sliding", "full"], sliding_window=4, rope_scaling="llama3",
                rope_original_max_seq_len=16)
    own = Transformer(ModelConfig(**base, rope_theta_sliding=1e4))
    assert [b.rope for b in own.layers] == ["sliding", "full"]
    assert torch.equal(own.rope_cos_sliding, rope_tables(16, 64, 1e4)[0])
    shared = Transformer(ModelConfig(**base))
    assert [b.rope for b in shared.layers] == ["full", "full"] and not hasattr(shared, "rope_cos_sliding")


# -- 2, 3: GGUF keys ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm_gguf(tmp_path_factory) -> Path:
    """A GGUF (llama, gpt2-style byte-level vocabulary) of a transformers-saved SmolLM-like folder."""
    tmp = tmp_path_factory.mktemp("gguf")
    build_folder("smollm", tmp / "hf")
    import_hf(tmp / "hf", tmp / "ckpt")
    export_gguf(tmp / "ckpt", tmp / "m.gguf")
    return tmp / "m.gguf"


def rewritten(path: Path, out: Path, edit) -> Path:
    """A copy of GGUF `path` whose keys `edit(dict key -> (value, types))` changed (tensors kept)."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(str(path))
    values = {k: (f.contents(), f.types) for k, f in r.fields.items()
              if not k.startswith("GGUF.") and k != "general.architecture"}
    edit(values)
    w = gguf.GGUFWriter(str(out), r.fields["general.architecture"].contents())
    for k, (v, types) in values.items():
        if types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(k, v)
        else:
            w.add_key_value(k, v, types[0])
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data).reshape([int(d) for d in reversed(t.shape.tolist())]))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return out


def test_gguf_gpt2_vocabulary_without_merges_is_refused(smollm_gguf, tmp_path):
    import gguf

    assert gguf.GGUFReader(str(smollm_gguf)).fields["tokenizer.ggml.model"].contents() == "gpt2"
    bad = rewritten(smollm_gguf, tmp_path / "nomerges.gguf", lambda kv: kv.pop("tokenizer.ggml.merges"))
    with pytest.raises(ExportError, match=r"nomerges\.gguf: tokenizer\.ggml\.model = 'gpt2'.*"
                                          r"no tokenizer\.ggml\.merges"):
        import_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key, value, want", [
    ("llama.rope.freq_base", "10000.0", "a number"),
    ("llama.rope.freq_base", "ten thousand", "a number"),
    ("llama.attention.layer_norm_rms_epsilon", "1e-6", "a number"),
    ("tokenizer.ggml.bos_token_id", "0", "an integer"),
    ("tokenizer.ggml.add_bos_token", "false", "a boolean"),
])
def test_gguf_key_of_the_wrong_type_is_refused_naming_it(smollm_gguf, tmp_path, key, value, want):
    import gguf

    bad = rewritten(smollm_gguf, tmp_path / "bad.gguf",
                    lambda kv: kv.update({key: (value, [gguf.GGUFValueType.STRING])}))
    with pytest.raises(ExportError, match=rf"bad\.gguf: {key.replace('.', r'[.]')} = '{value}': expected {want}"):
        import_gguf(bad, tmp_path / "out")


def test_gguf_value_out_of_range_is_refused_under_its_key(smollm_gguf, tmp_path):
    import gguf

    bad = rewritten(smollm_gguf, tmp_path / "bad.gguf",
                    lambda kv: kv.update({"llama.rope.freq_base": (0.5, [gguf.GGUFValueType.FLOAT32])}))
    with pytest.raises(ExportError, match=r"bad\.gguf: llama\.rope\.freq_base = 0\.5: expected 1 < value"):
        import_gguf(bad, tmp_path / "out")


def test_gguf_errors_name_the_file_not_the_converted_folder(smollm_gguf, tmp_path):
    """An error found in the converted Hugging Face files names the GGUF file and which of its keys,
    never the temporary folder (deleted by then) or a file the user does not have."""
    import gguf

    bad = rewritten(smollm_gguf, tmp_path / "bos.gguf",
                    lambda kv: kv.update({"tokenizer.ggml.add_bos_token": (True, [gguf.GGUFValueType.BOOL])}))
    with pytest.raises(LmforgeError) as info:
        import_gguf(bad, tmp_path / "out")
    msg = str(info.value)
    assert msg.startswith(f"{bad} (its tokenizer.ggml.* special tokens"), msg
    assert "lmforge-gguf-" not in msg and "--from" not in msg and "converted to Hugging Face files" not in msg


# -- 4: the rotary tables' memory ------------------------------------------------------------------------
_MEASURE = r"""
import resource, sys
import torch
from lmforge.config import ModelConfig
from lmforge.model import Transformer
from lmforge.model.memory import memory_need

def peak():
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024

cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=1 << 21, qk_norm=False,
                  layer_types=["sliding", "full"], sliding_window=8, rope_theta=1e6, rope_theta_sliding=1e4)
Transformer(ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=8))  # warm
before = peak()
Transformer(cfg)
print(peak() - before, memory_need(cfg, training=False)[0])
"""


def test_memory_estimate_counts_both_rope_tables_and_their_temporaries():
    """A Gemma-3-like model (sliding layers with their own base) of 2M positions builds two pairs of
    tables; the estimate the memory check uses covers what construction takes (float64 temporaries
    included)."""
    out = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    grown, estimate = map(int, out.stdout.split())
    tables = 2 * 2 * 4 * (1 << 21) * 16  # two (cos, sin) float32 pairs of 2M x 16
    assert grown >= 0.9 * tables  # the measurement sees the tables
    # before: 1,040 MiB grown against 256 MiB estimated (4x); the process's own allocator and threads
    # add some tens of MiB on a busy machine
    assert grown <= 1.25 * estimate, (grown / 2**20, estimate / 2**20)


_REFUSED = r"""
import resource
from lmforge.errors import ConfigError
from lmforge.model.transformer import rope_tables

size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    rope_tables(64, 1 << 26, 1e4)
except ConfigError as exc:
    print("ConfigError", exc)
"""


def test_memory_refused_while_building_rope_tables_is_a_config_error():
    out = subprocess.run([sys.executable, "-c", _REFUSED], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ConfigError model.max_seq_len = 67,108,864"), out.stdout
    assert "Lower model.max_seq_len" in out.stdout


# -- 5-8: config.json values ------------------------------------------------------------------------------
def test_head_dim_zero_is_refused_not_derived(tmp_path, gemma3_folder):
    src = edited(gemma3_folder, tmp_path / "src", head_dim=0)
    with pytest.raises(ExportError, match=r"config\.json: head_dim = 0: expected a positive head size, or null"):
        import_hf(src, tmp_path / "out")


@pytest.mark.parametrize("value", ["false", "true", 0, 1])
def test_tie_word_embeddings_must_be_a_boolean(tmp_path, gemma3_folder, value):
    src = edited(gemma3_folder, tmp_path / "src", tie_word_embeddings=value)
    with pytest.raises(ExportError, match=rf"config\.json: tie_word_embeddings = {value!r}: expected true or false"):
        import_hf(src, tmp_path / "out")


@pytest.mark.parametrize("base", [1.0, 0.5])
def test_sliding_rope_base_at_most_one_is_refused(tmp_path, gemma3_folder, base):
    cfg = json.loads((gemma3_folder / "config.json").read_text())
    rope = cfg["rope_parameters"]
    rope["sliding_attention"]["rope_theta"] = base
    src = edited(gemma3_folder, tmp_path / "src", rope_parameters=rope)
    with pytest.raises(ExportError, match=rf"rope_parameters\.sliding_attention\.rope_theta = {base}: expected a RoPE "
                                          r"base above 1"):
        import_hf(src, tmp_path / "out")
    old = edited(gemma3_folder, tmp_path / "old", rope_parameters=None, rope_theta=1e6, rope_local_base_freq=base)
    with pytest.raises(ExportError, match=rf"rope_local_base_freq = {base}: expected a RoPE base above 1"):
        import_hf(old, tmp_path / "out")


def test_model_rope_theta_sliding_at_most_one_is_refused_as_rope_theta_is():
    cfg = Config()
    cfg.model.n_layers, cfg.model.layer_types, cfg.model.sliding_window = 2, ["sliding", "full"], 8
    cfg.model.rope_theta_sliding = 0.5
    with pytest.raises(ConfigError, match=r"model\.rope_theta_sliding = 0\.5: expected 0 .* or a RoPE base above 1"):
        validate(cfg)
    cfg.model.rope_theta_sliding = 1e4
    validate(cfg)


@pytest.mark.parametrize("changes, key", [
    ({"query_pre_attn_scalar": 1e-12}, r"query_pre_attn_scalar = 1e-12 makes lmforge's model\.attn_scale"),
    ({"rms_norm_eps": 2.0}, r"rms_norm_eps = 2\.0: expected 0 < value <= 1 \(lmforge's model\.norm_eps\)"),
    ({"final_logit_softcapping": 1e9}, r"final_logit_softcapping = 1000000000\.0: expected"),
    ({"num_key_value_heads": 3, "num_attention_heads": 4}, r"num_attention_heads = 4 is not divisible by "
                                                           r"num_key_value_heads = 3"),
])
def test_out_of_range_values_are_reported_under_the_config_json_key(tmp_path, gemma3_folder, changes, key):
    src = edited(gemma3_folder, tmp_path / "src", **changes)
    with pytest.raises(ExportError, match=r"config\.json: " + key) as info:
        import_hf(src, tmp_path / "out")
    assert "maps to an lmforge config" not in str(info.value)


def test_llama3_rope_out_of_range_is_reported_under_its_key(tmp_path):
    build_folder("llama3", tmp_path / "hf")
    rope = {**LLAMA3_ROPE, "factor": 0.5}
    src = edited(tmp_path / "hf", tmp_path / "src", rope_parameters=rope)
    with pytest.raises(ExportError, match=r"rope_parameters\.factor = 0\.5: expected 1 <= value"):
        import_hf(src, tmp_path / "out")


# -- 9: errors name the user's file and flag -----------------------------------------------------------
def test_import_hf_errors_name_its_folder_not_import_tokenizers_flag(tmp_path, gemma3_folder):
    src = tmp_path / "src"
    shutil.copytree(gemma3_folder, src)
    (src / "tokenizer.json").unlink()
    with pytest.raises(LmforgeError) as info:
        import_hf(src, tmp_path / "out")
    msg = str(info.value)
    assert msg.startswith(f"{src}: no tokenizer.json there") and "--from" not in msg, msg


def test_import_hf_nonfinite_weight_names_the_folder_not_a_temporary(tmp_path, gemma3_folder):
    from lmforge.fileio import load_safetensors, save_safetensors

    src = tmp_path / "src"
    shutil.copytree(gemma3_folder, src)
    state = load_safetensors(src / "model.safetensors")
    state["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    save_safetensors(state, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ExportError) as info:
        import_hf(src, tmp_path / "out")
    msg = str(info.value)
    assert msg.startswith(f"{src}: weight model.layers.0.mlp.up_proj.weight holds NaN"), msg
    assert ".tmp-" not in msg and "checkpoint of the run" not in msg


# -- 10: inert mechanism settings ---------------------------------------------------------------------------
def test_sliding_window_without_a_sliding_layer_is_refused():
    cfg = Config()
    cfg.model.sliding_window = 8
    with pytest.raises(ConfigError, match=r"model\.sliding_window = 8 but model\.layer_types = \[\] has no "
                                          r"\"sliding\" layer"):
        validate(cfg)
    cfg.model.layer_types = ["sliding"] + ["full"] * (cfg.model.n_layers - 1)
    validate(cfg)


def test_rope_theta_sliding_without_a_sliding_layer_is_refused():
    cfg = Config()
    cfg.model.rope_theta_sliding = 1e4
    with pytest.raises(ConfigError, match=r"model\.rope_theta_sliding = 10000\.0 but model\.layer_types has no"):
        validate(cfg)

