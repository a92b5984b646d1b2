"""A user's model at its own size: weights read straight into the model (`fileio.SafetensorsReader`),
no random draw for what is loaded next, a tied head never allocated, finiteness checked in slices,
AdamW without a copy of every parameter, and the fused loss's weight gradient handed over in place."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmforge.config import ModelConfig
from lmforge.errors import CheckpointError
from lmforge.fileio import SafetensorsReader
from lmforge.model import Transformer
from lmforge.model.io import all_finite, load_weights, model_state
from lmforge.model.loss import linear_cross_entropy_sum

TENSORS = {
    "f32": torch.randn(7, 5),
    "bf16": torch.randn(3, 4).bfloat16(),
    "f16": torch.randn(6).half(),
    "f64": torch.randn(2, 2).double(),
    "i64": torch.arange(-5, 5),
    "i32": torch.arange(9, dtype=torch.int32).reshape(3, 3),
    "u8": torch.arange(200, 256, dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "scalar": torch.tensor(3.5),
    "empty": torch.zeros(0, 4),
}


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_reader_reads_every_dtype_as_safetensors_does(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file(TENSORS, str(path), metadata={"who": "lmforge"})
    want = load_file(str(path))
    with SafetensorsReader(path) as r:
        assert r.metadata == {"who": "lmforge"} and set(r.entries) == set(want)
        for name, (dtype, shape, _, _) in r.entries.items():
            out = torch.full(shape, 7, dtype=dtype) if dtype != torch.bool else torch.zeros(shape, dtype=dtype)
            r.read_into(name, out)
            assert out.dtype == want[name].dtype and torch.equal(out, want[name]), name
        with pytest.raises(ValueError, match="cannot be read into"):  # the caller's tensor must fit exactly
            r.read_into("f32", torch.empty(5, 7))


def _rewrite_header(path, change) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


DAMAGES = {
    "cut short": (lambda p: p.write_bytes(p.read_bytes()[:-3]), "the file at"),
    "padded": (lambda p: p.write_bytes(p.read_bytes() + b"\0"), "the file at"),
    "an unknown dtype": (lambda p: _rewrite_header(p, lambda h: h["f32"].update(dtype="F42")), "does not define"),
    "a shape that is not its bytes": (lambda p: _rewrite_header(p, lambda h: h["f32"].update(shape=[7, 4])),
                                      "bytes for shape"),
    "overlapping data": (lambda p: _rewrite_header(p, lambda h: h["i64"].update(data_offsets=h["f32"]["data_offsets"])),
                         "bytes for shape|back to back"),
    "a header longer than the file": (lambda p: p.write_bytes((10 ** 9).to_bytes(8, "little") + p.read_bytes()[8:]),
                                      "a header of"),
    "not JSON": (lambda p: p.write_bytes(p.read_bytes()[:8] + b"x" + p.read_bytes()[9:]), "Expecting value"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_file_is_refused_before_any_tensor_is_read(tmp_path, damage):
    path = tmp_path / "t.safetensors"
    save_file(TENSORS, str(path))
    spoil, match = DAMAGES[damage]
    spoil(path)
    before = sha(path)
    with pytest.raises(ValueError, match=match):
        SafetensorsReader(path)
    assert sha(path) == before


def tiny(vocab: int = 96, dim: int = 32, tied: bool = True) -> ModelConfig:
    return ModelConfig(dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab, max_seq_len=32,
                       tie_embeddings=tied)


@pytest.mark.parametrize("tied", [True, False])
def test_a_model_built_to_be_loaded_equals_the_saved_one(tmp_path, tied):
    """`Transformer(init_weights=False)` + `load_weights` = the model saved, a tied head the
    embedding itself (never a tensor of its own, nothing left on the meta device)."""
    torch.manual_seed(0)
    saved = Transformer(tiny(tied=tied))
    path = tmp_path / "model.safetensors"
    save_file(model_state(saved), str(path))
    got = Transformer(tiny(tied=tied), init_weights=False)
    load_weights(got, path)
    assert not any(p.is_meta for p in got.parameters())
    assert (got.output.weight is got.tok_embeddings.weight) == tied
    for (n, p), (_, q) in zip(saved.state_dict().items(), got.state_dict().items()):
        assert torch.equal(p, q), n
    x = torch.randint(0, 96, (2, 9))
    assert torch.equal(saved(x), got(x))


def test_weights_of_another_dtype_are_converted_and_a_nan_is_refused(tmp_path):
    torch.manual_seed(0)
    saved = Transformer(tiny())
    state = {k: v.bfloat16() for k, v in model_state(saved).items()}
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    got = Transformer(tiny(), init_weights=False)
    load_weights(got, path)
    for k, v in state.items():
        assert got.state_dict()[k].dtype == torch.float32 and torch.equal(got.state_dict()[k], v.float()), k
    state["layers.1.attention.wq.weight"][3, 4] = float("nan")
    save_file(state, str(path))
    before = sha(path)
    with pytest.raises(CheckpointError, match=r"layers\.1\.attention\.wq\.weight holds NaN"):
        load_weights(Transformer(tiny(), init_weights=False), path)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match="cannot read weights"):
        load_weights(Transformer(tiny(), init_weights=False), path)
    assert sha(path) != before  # (cut by the test itself)


def test_all_finite_looks_at_every_slice(monkeypatch):
    import lmforge.model.io as io

    monkeypatch.setattr(io, "_FINITE_SLICE", 4)
    t = torch.zeros(11)
    assert all_finite(t) and all_finite(torch.arange(5))
    for i, bad in ((0, float("inf")), (5, float("nan")), (10, float("-inf"))):
        u = t.clone()
        u[i] = bad
        assert not all_finite(u), i


def test_loading_peaks_at_the_models_size(tmp_path):
    """Peak resident memory of `Transformer(init_weights=False)` + `load_weights` in a fresh process,
    over what it held before: under 1.6x the weights' bytes (it was ~3x: safetensors' mapped file,
    its copy, and a randomly initialised model with draws of each weight's size)."""
    torch.manual_seed(0)
    model = Transformer(tiny(vocab=65536, dim=512))  # a 128 MB tied embedding dominates, as 262k ids do
    path = tmp_path / "model.safetensors"
    save_file(model_state(model), str(path))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    code = textwrap.dedent(f"""
        import torch
        from pathlib import Path
        from lmforge.config import ModelConfig
        from lmforge.model import Transformer
        from lmforge.model.io import load_weights
        torch.ones(4, 4) @ torch.ones(4, 4)
        before = int(open("/proc/self/statm").read().split()[1]) * 4096
        m = Transformer(ModelConfig(dim=512, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=65536, max_seq_len=32,
                                    tie_embeddings=True), init_weights=False)
        load_weights(m, Path({str(path)!r}))
        # VmHWM: this process image's own peak (ru_maxrss would carry the forking test process's over exec)
        hwm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM"))
        print(hwm * 1024 - before)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    grew = int(out.stdout.strip().splitlines()[-1])
    assert grew < 1.6 * nbytes, (grew, nbytes)  # 1.2-1.4x seen (torch's own first allocations beside)


def test_the_fused_losss_weight_gradient_is_handed_over_once():
    torch.manual_seed(0)
    h = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(50, 8, requires_grad=True)
    targets, mask = torch.randint(0, 50, (10,)), torch.ones(10, dtype=torch.bool)
    loss = linear_cross_entropy_sum(h, w, targets, mask, chunk_rows=3)
    (loss * 0.5).backward(retain_graph=True)
    ref_w = w.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h.detach().double() @ ref_w.T, targets, reduction="sum")
    (ref * 0.5).backward()
    torch.testing.assert_close(w.grad.double(), ref_w.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # autograd's own guard
        loss.backward()


def test_muon_adamws_adam_groups_step_slice_by_slice_as_in_one_piece(monkeypatch):
    import lmforge.train.optim as optim

    torch.manual_seed(0)
    runs = []
    for slice_ in (1 << 22, 5):
        monkeypatch.setattr(optim, "ADAM_SLICE", slice_)
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(7, 6)), torch.nn.Parameter(torch.randn(13))]
        opt = optim.MuonAdamW([dict(params=ps, kind="adamw", weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)],
                              lr=1e-2)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn_like(p)
            opt.step()
        runs.append([p.detach().clone() for p in ps])
    assert all(torch.equal(x, y) for x, y in zip(*runs))
