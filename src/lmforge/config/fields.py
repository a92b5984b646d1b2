"""How a config field declares itself: once, beside its default and its docstring.

Each field of a section is written as `name: type = num(...)` (a number and its range),
`choice(...)` (a text with a fixed set of values), `text(...)`, `flag(...)`, `items(...)` or
`table(...)` (a TOML table of options, `[data.executor]`),
each taking the field's `--resume` rule (`refused(...)` / `allowed(...)`) and, where a field
has one, its own extra check. The field's docstring below it is its help. Everything else is
derived from these declarations: `config.BOUNDS`, `config.CHOICES`, the single-field checks of
`config.validate`, and `train.resume.RESUME_RULES`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmforge.errors import ConfigError

#: The stages (commands) that train from a config, in the order of the speedrun.
STAGES = ("pretrain", "sft", "dpo", "rl")
BOTH, PRE, SFT, DPO, RL, TUNE = STAGES, ("pretrain",), ("sft",), ("dpo",), ("rl",), ("sft", "dpo", "rl")
#: In a fine-tuning section's rule (`config.TuningConfig`): that section's own stage.
HERE = ("{section}",)


@dataclass(frozen=True)
class ResumeRule:
    """One config field under `--resume` (lmforge.train.resume).

    `refused_in`: the stages (commands) in which another value is refused; in the others
    a change is allowed. `why`: why it is refused (the message says it), or, for a field
    refused nowhere, why a change is safe. `otherwise`: why a change is safe where the
    field is not refused (another stage, or a run `when` does not hold for). `schedule`: the
    field shapes the learning-rate schedule; another value is refused only when it changes
    the learning rate of a step already taken (`lr_at`, step by step). `per_rank`: compared
    times the data-parallel ranks (accumulation: the rows of an optimizer step are micro-batch
    x accumulation x ranks, `RowStream`). `when`: the rule applies only to runs (saved
    configs) for which it holds. `elsewhere`: compared by another check, named in `why`.
    `path`: a path, compared resolved (`runs/x/data` and `./runs/x/data` are one folder).
    """

    field: str
    refused_in: tuple[str, ...]
    why: str
    otherwise: str = ""
    schedule: bool = False
    per_rank: bool = False
    when: Callable[..., bool] | None = None
    elsewhere: bool = False
    path: bool = False


def refused(stages: tuple[str, ...], why: str, otherwise: str = "", **flags: Any) -> ResumeRule:
    """The rule of a field another value of which is refused in `stages` (field filled in later)."""
    return ResumeRule("", stages, why, otherwise, **flags)


def allowed(why: str) -> ResumeRule:
    """The rule of a field a change of which is safe everywhere, and why."""
    return ResumeRule("", (), why)


#: (low, high, low_open, high_open): a number's range.
Bound = tuple[float, float, bool, bool]


def _declare(default: Any, resume: ResumeRule, *, factory: Callable[[], Any] | None = None, **meta: Any):
    meta = {"resume": resume, **{k: v for k, v in meta.items() if v is not None}}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def num(default: float, low: float, high: float, resume: ResumeRule, *, low_open: bool = False,
        high_open: bool = False, check: Callable[[str, Any], None] | None = None):
    """A number in [low, high] (an end excluded with `low_open` / `high_open`)."""
    return _declare(default, resume, bounds=(low, high, low_open, high_open), check=check)


def choice(default: str, options: tuple[str, ...], resume: ResumeRule):
    """A text field whose value is one of `options` (the tables that dispatch on it are held
    equal to them by tests/test_config.py)."""
    return _declare(default, resume, choices=tuple(options))


def text(default: str, resume: ResumeRule, *, nonempty: bool = False):
    """A text field (a path, a token); `nonempty`: "" is refused."""
    return _declare(default, resume, nonempty=nonempty or None)


def flag(default: bool, resume: ResumeRule):
    return _declare(default, resume)


def items(default: tuple[str, ...], resume: ResumeRule, *, check: Callable[[str, Any], None] | None = None):
    """A list of texts (default: a copy of `default`)."""
    return _declare(None, resume, factory=lambda: list(default), check=check)


def table(resume: ResumeRule, *, check: Callable[[str, Any], None] | None = None):
    """A TOML table of options (default: empty), each checked by `check`."""
    return _declare(None, resume, factory=dict, check=check)


def declared(cls: type) -> dict[str, dict[str, Any]]:
    """{field name: its declaration (the metadata above)} of a section class."""
    return {f.name: dict(f.metadata) for f in dataclasses.fields(cls)}


def resume_rules(section: str, cls: type) -> tuple[ResumeRule, ...]:
    """The rules of `section`'s fields, with "{section}" and the section's WORDS filled in."""
    words = {"section": section, "SECTION": section.upper(), **getattr(cls, "WORDS", {})}
    fill = (lambda s: s.format(**words)) if hasattr(cls, "WORDS") else (lambda s: s)
    out = []
    for name, meta in declared(cls).items():
        rule = meta["resume"]
        when = rule.when
        if when is not None and getattr(when, "per_section", False):
            when = (lambda w, s: lambda cfg: w(cfg, s))(when, section)
        out.append(dataclasses.replace(
            rule, field=f"{section}.{name}", refused_in=tuple(fill(s) for s in rule.refused_in),
            why=fill(rule.why), otherwise=fill(rule.otherwise), when=when))
    return tuple(out)


def per_section(fn: Callable[..., bool]) -> Callable[..., bool]:
    """Mark a `when` of a fine-tuning field as taking (config, section)."""
    fn.per_section = True  # type: ignore[attr-defined]
    return fn


def again(cls: type, name: str, default: Any):
    """`cls`'s declaration of the field `name` with another default (a subclass's)."""
    return dataclasses.field(default=default, metadata=cls.__dataclass_fields__[name].metadata)


def suggest(name: str, options: list[str]) -> str:
    """" Did you mean 'x'?" for the closest of `options`, or the list of them."""
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    if close:
        return f" Did you mean {close[0]!r}?"
    return f" Known: {', '.join(sorted(options))}."


def check_number(cls: type, key: str, value: float, name: str, shown: str | None = None) -> None:
    """Raise ConfigError unless `value` lies in the range `cls` declares for its field `key`
    (`name`: "section.key"); the message names the field, the value, the range and the default.
    `shown`: the name to show instead (a server request's field, e.g. "max_tokens"; no default
    then); the error's `field` attribute is the name shown."""
    spec = cls.__dataclass_fields__[key]
    low, high, low_open, high_open = spec.metadata["bounds"]
    ok = math.isfinite(value) and (low < value if low_open else low <= value) and (
        value < high if high_open else value <= high)
    if not ok:
        default = f" (default {spec.default!r})" if shown is None else ""
        err = ConfigError(f"{shown or name} = {value!r}: expected {low} {'<' if low_open else '<='} value "
                          f"{'<' if high_open else '<='} {high}{default}.")
        err.field = shown or name
        raise err
