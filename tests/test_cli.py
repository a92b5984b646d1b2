"""The command line: bad input prints one `error:` line (no traceback) and exits 2;
every subcommand has a working --help."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.train import checkpoint as ckpt

from conftest import make_corpus

SUBCOMMANDS = ["train-tokenizer", "import-tokenizer", "prepare", "pretrain", "sft", "generate", "chat", "eval",
               "export", "import-hf", "import-gguf", "serve", "speedrun"]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_subcommand_help(sub, capsys):
    with pytest.raises(SystemExit) as exc:
        main([sub, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: lmforge {sub}")
    assert "--config FILE" in out and "--set SECTION.KEY=VALUE" in out


def test_top_level_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for sub in SUBCOMMANDS:
        assert sub in out


def test_no_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert "usage: lmforge" in capsys.readouterr().err


@pytest.mark.parametrize("sub", ["train-tokenizer", "prepare", "pretrain", "speedrun"])
def test_set_typo_exits_2_with_one_line(sub, tmp_path, capsys):
    code = main([sub, "--set", "train.stpes=3", "--out", str(tmp_path / "out")])
    assert code == 2
    line = one_error_line(capsys)
    assert "train.stpes" in line and "Did you mean 'steps'?" in line
    assert not (tmp_path / "out").exists()


def test_config_file_typo(tmp_path, capsys):
    recipe = tmp_path / "r.toml"
    recipe.write_text("[model]\ndim = 64\nn_layer = 2\n", encoding="utf-8")
    assert main(["prepare", "--config", str(recipe), "--out", str(tmp_path / "data")]) == 2
    line = one_error_line(capsys)
    assert str(recipe) in line and "model.n_layer" in line and "Did you mean 'n_layers'?" in line


def test_missing_config_file(tmp_path, capsys):
    assert main(["pretrain", "--config", str(tmp_path / "nope.toml"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in one_error_line(capsys)


def test_missing_data_path(tmp_path, tiny_tokenizer, capsys):
    out = tmp_path / "data"
    code = main(["prepare", "--set", f"tokenizer.dir={tiny_tokenizer.folder}",
                 "--set", f"data.source={tmp_path / 'no-such-corpus'}", "--out", str(out), "--no-progress"])
    assert code == 2
    line = one_error_line(capsys)
    assert str(tmp_path / "no-such-corpus") in line and "does not exist" in line
    assert not out.exists() and not (tmp_path / "data.tmp").exists()


def test_empty_data_folder(tmp_path, tiny_tokenizer, capsys):
    (tmp_path / "empty").mkdir()
    code = main(["train-tokenizer", "--set", f"data.source={tmp_path / 'empty'}",
                 "--set", "tokenizer.vocab_size=300", "--out", str(tmp_path / "tok"), "--no-progress"])
    assert code == 2
    assert "holds no .txt/.md/.py files" in one_error_line(capsys)
    assert not (tmp_path / "tok").exists() and not (tmp_path / "tok.tmp").exists()


def test_non_utf8_fails_by_flag(tmp_path, tiny_tokenizer, capsys):
    corpus = make_corpus(tmp_path / "corpus", n_docs=10)
    (corpus / "latin1.txt").write_bytes(b"na\xefve\n")
    code = main(["prepare", "--set", f"tokenizer.dir={tiny_tokenizer.folder}", "--set", f"data.source={corpus}",
                 "--set", "data.on_bad_utf8=error", "--out", str(tmp_path / "data"), "--no-progress"])
    assert code == 2
    assert str(corpus / "latin1.txt") in one_error_line(capsys)
    assert not (tmp_path / "data").exists() and not (tmp_path / "data.tmp").exists()


def test_train_tokenizer_then_prepare(tmp_path, capsys):
    """The first two stages through the command line, with a non-UTF-8 file skipped and counted."""
    from lmforge.config import load_config
    from lmforge.tokenizer import Tokenizer

    corpus = make_corpus(tmp_path / "corpus", n_docs=20)
    (corpus / "latin1.txt").write_bytes(b"na\xefve\n")
    sets = ["--set", f"data.source={corpus}", "--set", "tokenizer.vocab_size=300", "--set", "data.val_fraction=0.2"]
    assert main(["train-tokenizer", *sets, "--out", str(tmp_path / "tok"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "1 non-UTF-8 files skipped" in err
    tok = Tokenizer.load(tmp_path / "tok")
    assert tok.vocab_size == 300
    assert load_config(tmp_path / "tok" / "config.toml") == load_config(None, sets[1::2])
    code = main(["prepare", *sets, "--set", f"tokenizer.dir={tmp_path / 'tok'}", "--out", str(tmp_path / "data"),
                 "--no-progress"])
    assert code == 0
    assert "'skipped_bad_utf8': 1" in capsys.readouterr().err
    for name in ("train.bin", "train.idx", "val.bin", "val.idx", "contract.json", "meta.json", "config.toml"):
        assert (tmp_path / "data" / name).is_file(), name


def test_pretrain_without_out(capsys):
    assert main(["pretrain"]) == 2
    assert "--out" in one_error_line(capsys)


def test_pretrain_on_unprepared_data(tmp_path, tiny_tokenizer, capsys):
    code = main(["pretrain", "--set", f"tokenizer.dir={tiny_tokenizer.folder}",
                 "--set", f"data.dir={tmp_path / 'nothing'}", "--out", str(tmp_path / "run")])
    assert code == 2
    assert "lmforge prepare" in one_error_line(capsys)
    assert not (tmp_path / "run").exists()


@pytest.fixture
def checkpoint_dir(tiny_run, tmp_path) -> Path:
    from lmforge.model import Transformer, resolve_model_config

    cfg, tok = tiny_run
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    return ckpt.save_checkpoint(tmp_path / "run", 1, model, cfg, tok.folder)


def test_generate_greedy_on_a_checkpoint(checkpoint_dir, capsys):
    code = main(["generate", "--checkpoint", str(checkpoint_dir.parent), "--prompt", "def ",
                 "--greedy", "--max-new-tokens", "4"])
    assert code == 0
    assert capsys.readouterr().out.startswith("def ")


@pytest.mark.parametrize("sub", ["generate", "eval"])
def test_checkpoint_without_its_contract(checkpoint_dir, sub, capsys):
    (checkpoint_dir / "contract.json").unlink()
    args = [sub, "--checkpoint", str(checkpoint_dir)] + (["--prompt", "x"] if sub == "generate" else [])
    assert main(args) == 2
    line = one_error_line(capsys)
    assert f"checkpoint {checkpoint_dir} has no contract.json" in line


def test_not_a_checkpoint(tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 2
    assert "not a checkpoint" in one_error_line(capsys)


@pytest.mark.slow  # a fresh interpreter imports torch
def test_console_script_config_typo(tmp_path):
    """The installed `lmforge` script: exit status 2, one error line, no traceback."""
    exe = Path(sys.executable).with_name("lmforge")
    if not exe.exists():
        exe = shutil.which("lmforge")
    if not exe:
        pytest.skip("the lmforge console script is not installed")
    proc = subprocess.run([str(exe), "prepare", "--set", "data.seq_lenn=64", "--out", str(tmp_path / "d")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: ") and "Did you mean 'seq_len'?" in proc.stderr
    assert proc.stdout == ""


def test_python_dash_m(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lmforge", "eval", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "--checkpoint DIR" in proc.stdout
