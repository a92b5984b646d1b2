"""A figure the README states is measured on the command the README shows: a benchmark that trains
through a stage runs that command's own configuration and changes only the seed and the time.

Each test builds the benchmark's configuration and the command's (parsed from the README as typed,
through the CLI's own parser and config loader) and fails on any other difference."""

from __future__ import annotations

import dataclasses
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

#: what a benchmark may change in a command's configuration
SEED_AND_TIME = {"train.seed", "train.time_limit_s"}


def flat(cfg) -> dict[str, object]:
    """{"section.key": value} of a Config."""
    out = {}
    for s in dataclasses.fields(cfg):
        section = getattr(cfg, s.name)
        if dataclasses.is_dataclass(section):  # the sections (set_keys, which records what was typed, is not one)
            out.update({f"{s.name}.{k}": v for k, v in dataclasses.asdict(section).items()})
    return out


def readme_command(prefix: str) -> list[str]:
    """The README's first command line that starts with `prefix` (continuations joined), as argv:
    README.md's, then its pages' in docs/ (the RL and DPO commands are on docs/rl.md and
    docs/preference-tuning.md), in the order tests/test_readme.py runs them."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    text = "\n".join(p.read_text(encoding="utf-8") for p in pages)
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith(prefix):
                return shlex.split(line)
    raise AssertionError(f"the README shows no command starting with {prefix!r}")


def command_config(argv: list[str], replace_init: tuple[str, str]):
    """The config the CLI's parser and loader give for `argv` (argv[0] = "lmforge"), with the
    checkpoint path `replace_init` = (README's, benchmark's) swapped."""
    from lmforge.cli import _config, build_parser

    argv = [a.replace(*replace_init) for a in argv[1:]]
    return _config(build_parser().parse_args(argv))


def differences(a, b) -> set[str]:
    fa, fb = flat(a), flat(b)
    return {k for k in fa if fa[k] != fb[k]}


@pytest.mark.parametrize("minutes", [0.0, 2.0])
def test_bench_rl_runs_the_readme_rl_command_changing_only_seed_and_time(minutes):
    import bench_rl

    argv = readme_command("lmforge rl --set rl.init=runs/speedrun/sft --out runs/rl")
    ckpt = "/tmp/some/sft"
    readme = command_config(argv, ("runs/speedrun/sft", ckpt))
    bench = bench_rl.arm_config(Path(ckpt), "full", list(readme.rl.rewards), seed=7, minutes=minutes)
    assert differences(bench, readme) <= SEED_AND_TIME, differences(bench, readme) - SEED_AND_TIME
    assert bench.train.seed == 7 and bench.train.time_limit_s == minutes * 60
    # the LoRA arm is that command with the README's LoRA settings (its second rl command), and nothing else
    lora = bench_rl.arm_config(Path(ckpt), "lora", list(readme.rl.rewards), seed=7, minutes=minutes)
    assert differences(lora, readme) - SEED_AND_TIME == {"lora.rank", "rl.lr"}
    mine = command_config(readme_command("lmforge rl --set rl.init=runs/speedrun/sft --set rl.data=my_prompts.jsonl"),
                          ("runs/speedrun/sft", ckpt))
    assert (lora.lora.rank, lora.rl.lr) == (mine.lora.rank, mine.rl.lr)


def test_the_tuning_stages_train_with_the_optimizer_and_schedule_their_figures_were_measured_with():
    """RL and DPO do not inherit [train]'s Muon and warm-up-stable-decay (pretraining's): their
    sections declare AdamW (RL at a constant rate, DPO cosine), and `tuning_config` applies them."""
    from lmforge.config import load_config
    from lmforge.stages.tuning import tuning_config

    cfg = load_config(ROOT / "configs" / "stdlib-tiny.toml", [])
    assert cfg.train.optimizer == "muon"
    for key, optimizer, schedule in (("rl", "adamw", "constant"), ("dpo", "adamw", "cosine"),
                                     ("sft", "muon", "wsd")):
        train = tuning_config(cfg, cfg.model, key).train
        assert (train.optimizer, train.schedule) == (optimizer, schedule), key
    mine = load_config(None, ["rl.optimizer=muon", "rl.schedule=wsd"])
    assert tuning_config(mine, mine.model, "rl").train.optimizer == "muon"


def test_bench_dpo_runs_the_readme_dpo_command_changing_only_the_seed(tmp_path):
    import bench_dpo

    argv = readme_command("lmforge dpo --set dpo.init=runs/speedrun/sft --out runs/dpo")
    ckpt = "/tmp/some/sft"
    readme = command_config(argv, ("runs/speedrun/sft", ckpt))
    for kind, extra in (("full", set()), ("lora", {"lora.rank"}), ("shuffled", {"dpo.data"})):
        data = tmp_path / "shuffled.jsonl" if kind == "shuffled" else None
        bench = bench_dpo.arm_config(Path(ckpt), kind, seed=7, data=data)
        assert differences(bench, readme) - SEED_AND_TIME == extra, (kind, differences(bench, readme))
