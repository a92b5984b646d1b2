"""Evaluation suites (`lmforge eval --tasks`, lmforge.evals): E1 centring (uniform logits score
exactly the random baseline, ties at 1/k; an oracle scores 1), E3 token boundaries (the
continuation's tokens are the joint encoding's), E4 pass@k (Chen et al.'s estimator against exact
combinations), E5 determinism (a byte-identical results JSON), E6 bad input (one line, exit 2,
the file untouched)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import replace
from itertools import combinations
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.errors import ConfigError, DataError
from lmforge.evals import suite as suite_module
from lmforge.evals.builtin import BUILTIN_TASKS, builtin_tasks
from lmforge.evals.metrics import centred, choice_score, pass_at_k
from lmforge.evals.scoring import LogLikelihood, encode_pair, loglikelihoods
from lmforge.evals.suite import run_suite, score_task
from lmforge.evals.tasks import Choice, Continuation, Task, read_task_file
from lmforge.model import Transformer, resolve_model_config

from test_cli import one_error_line


@pytest.fixture(scope="module")
def small_tasks():
    """Every built-in task, 12 items each (read from the real held-out modules)."""
    return builtin_tasks(BUILTIN_TASKS, 0.02, False, seed=0, limit=12)


def _model(tiny_run, uniform: bool) -> Transformer:
    cfg, tok = tiny_run  # room for the built-in tasks' longest bodies in the tiny tokenizer's tokens
    model = Transformer(resolve_model_config(replace(cfg.model, max_seq_len=2048), tok.contract))
    model.reset_parameters(seed=0)
    if uniform:
        with torch.no_grad():
            model.output.weight.zero_()  # every logit 0: every token has probability 1/V
    return model.eval()


def _user_task(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- E1 -----------------------------------------------------------------------------------------------
def test_e1_uniform_logits_score_exactly_the_baseline(tiny_run, small_tasks, tmp_path):
    _, tok = tiny_run
    model = _model(tiny_run, uniform=True)
    mine = read_task_file(_user_task(tmp_path / "mine.jsonl", [
        {"query": "x = ", "choices": ["1", "22", "333"], "gold": 2},
        {"query": "def f(", "choices": ["a):", "self, b, c):"], "gold": 0}]))
    res = run_suite(model, tok, [*small_tasks, mine])
    for name, r in res["tasks"].items():
        if r["kind"] == "choice":  # all options tie: 1/k each, whatever their lengths
            assert r["accuracy"] == pytest.approx(r["baseline"], abs=1e-12), name
            assert r["centred"] == pytest.approx(0.0, abs=1e-12)
        else:
            assert r["accuracy"] == 0.0 and r["baseline"] == 0.0  # argmax of a tie is one token, rarely the right one
    assert res["tasks"]["mine"]["baseline"] == pytest.approx((1 / 3 + 1 / 2) / 2)
    assert {"mutants", "docstrings", "next_line", "identifier"} <= res["tasks"].keys()


def test_e1_an_oracle_scores_one(tiny_run, small_tasks, monkeypatch):
    _, tok = tiny_run
    gold = {(x.query, x.choices[x.gold]) for t in small_tasks if t.kind == "choice" for x in t.items}

    def oracle(model, tok, requests, batch_size=16, device="cpu"):  # knows every right answer
        return [LogLikelihood(0.0 if r in gold else -5.0, 3, True) for r in requests]

    monkeypatch.setattr(suite_module, "loglikelihoods", oracle)
    res = run_suite(None, tok, small_tasks)
    assert all(r["accuracy"] == 1.0 and r["centred"] == 1.0 for r in res["tasks"].values())
    assert res["suite"] == 1.0


def test_ties_and_centring_by_hand():
    assert choice_score([1.0, 1.0, 2.0], 0, higher=False) == 0.5  # gold tied with one other
    assert choice_score([1.0, 1.0, 2.0], 2, higher=False) == 0.0
    assert choice_score([1.0, 1.0, 1.0, 1.0], 3, higher=True) == 0.25  # never "index 0 wins"
    assert choice_score([0.3, 0.1], 1, higher=False) == 1.0
    assert centred(0.25, 0.25) == 0.0 and centred(1.0, 0.25) == 1.0 and centred(0.625, 0.25) == 0.5


def test_the_built_in_tasks_are_held_out_and_well_formed(small_tasks):
    from lmforge.data.sources import split_of

    for t in small_tasks:
        assert len(t.items) == 12, t.name
        for x in t.items:
            module = x.where.split(":")[0]
            assert split_of(module, 0.02) == "val" or module.startswith("test.") or ".test" in module, x.where
            if isinstance(x, Choice):
                k = 2 if t.name == "mutants" else 4  # mutants: pairs (an untrained model scores 1/2 on them)
                assert len(x.choices) == k and len(set(x.choices)) == k and 0 <= x.gold < k
    golds = [x.gold for t in small_tasks if t.kind == "choice" and t.name != "mutants" for x in t.items]
    assert len(set(golds)) == 4  # the right option moves


def test_mutant_directions_are_balanced():
    """A model that only prefers one token of a pair (== over !=) must score chance: every direction
    is at most one ahead of its reverse over the task."""
    from collections import Counter

    from lmforge.data.stdlib_pairs import reverse
    from lmforge.evals.builtin import _functions, held_out_documents, mutants

    fx = _functions(held_out_documents(0.02, False), 400)
    items = mutants(fx, seed=0)
    assert len(items) >= 100 and all(len(x.choices) == 2 for x in items)
    diffs = Counter()
    for x in items:
        real, mut = x.choices[x.gold], x.choices[1 - x.gold]
        a = next(i for i in range(len(real)) if real[i] != mut[i])
        diffs[(real[a:a + 2], mut[a:a + 2])] += 1
    assert diffs[("==", "!=")] <= diffs[("!=", "==")] + 1
    assert diffs[("Tr", "Fa")] <= diffs[("Fa", "Tr")] + 1


# -- E3 -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("context,continuation", [("value = compute(a, ", "b)"), ("    return a ", "+ b"),
                                                   ("x =", " 1"), ("for i in", " range(10):")])
def test_e3_the_continuation_is_scored_on_the_joint_encoding(tiny_run, context, continuation):
    _, tok = tiny_run
    model = _model(tiny_run, uniform=False)
    ids, split = encode_pair(tok, context, continuation)
    start = list(tok.contract.document_start) or [tok.eos_id]
    assert ids == start + tok.encode(context + continuation)  # one encoding of the whole text
    assert tok.decode(ids[split:]).endswith(continuation.strip()) and split > len(start) - 1
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).float(), -1)[0]
    want = sum(float(logp[t - 1, ids[t]]) for t in range(split, len(ids)))
    got = loglikelihoods(model, tok, [(context, continuation)])[0]
    assert got.tokens == len(ids) - split and got.logprob == pytest.approx(want, abs=1e-4)
    batched = loglikelihoods(model, tok, [(context, continuation), ("a much longer context " * 5, "x")])[0]
    assert batched.logprob == pytest.approx(got.logprob, abs=1e-4)  # right padding changes nothing


# -- E4 -----------------------------------------------------------------------------------------------
def test_e4_pass_at_k():
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 3, 3) == 1.0  # k > n - c: every draw of k holds a correct one
    for n in range(1, 21):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - sum(1 for s in combinations(range(n), k) if all(i >= c for i in s)) / math.comb(n, k) \
                    if n <= 12 else 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
    with pytest.raises(ConfigError, match="k = 6 with n = 5"):
        pass_at_k(5, 1, 6)


# -- E5 and the command ---------------------------------------------------------------------------------
def test_e5_the_same_checkpoint_gives_a_byte_identical_json(init_ckpt, tmp_path, capsys):
    mine = _user_task(tmp_path / "mine.jsonl", [{"context": "import ", "continuation": "os"},
                                                {"context": "def f(x):\n    return ", "continuation": "x"}])
    outs = []
    for i in range(2):
        out = tmp_path / f"r{i}.json"
        assert main(["eval", "--checkpoint", str(init_ckpt), "--tasks", f"next_line,{mine}", "--limit", "6",
                     "--out", str(out)]) == 0
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    res = json.loads(outs[0])
    assert list(res["tasks"]) == ["next_line", "mine"] and res["tasks"]["next_line"]["n"] == 6
    assert res["tasks"]["mine"]["kind"] == "continuation" and res["limit"] == 6
    printed = capsys.readouterr().out
    assert "| next_line | choice | 6 |" in printed and "suite (mean centred score)" in printed


# -- E6 -----------------------------------------------------------------------------------------------
BAD_ROWS = [
    ([{"query": "q", "choices": ["a", "b"]}], "mine.jsonl:1: .*\"gold\""),
    ([{"query": "q", "choices": ["a", "b"], "gold": 2}], "mine.jsonl:1: \"gold\" is 2: .*from 0 to 1"),
    ([{"query": "q", "choices": ["a", "b"], "gold": True}], "mine.jsonl:1: \"gold\" is True"),
    ([{"query": "q", "choices": ["a"], "gold": 0}], "mine.jsonl:1: \"choices\""),
    ([{"query": "q", "choices": ["a", "a"], "gold": 0}], "mine.jsonl:1: \"choices\" repeats"),
    ([{"context": "c", "continuation": ""}], "mine.jsonl:1: \"continuation\" is ''"),
    ([{"text": "x"}], "mine.jsonl:1: neither"),
    ([{"context": "c", "continuation": "d"}, {"query": "q", "choices": ["a", "b"], "gold": 0}],
     "mine.jsonl:2: a choice item in a file whose first item"),
]


@pytest.mark.parametrize("rows,message", BAD_ROWS)
def test_e6_a_bad_task_file_names_file_line_and_field(rows, message, tmp_path):
    with pytest.raises(DataError, match=message):
        read_task_file(_user_task(tmp_path / "mine.jsonl", rows))


def test_e6_the_command_refuses_with_one_line_and_leaves_the_out_file(init_ckpt, tmp_path, capsys):
    out = tmp_path / "results.json"
    out.write_text("keep me\n")
    before = hashlib.sha256(out.read_bytes()).hexdigest()
    assert main(["eval", "--checkpoint", str(init_ckpt), "--tasks", "mutant", "--out", str(tmp_path / "x.json")]) == 2
    line = one_error_line(capsys)
    assert "'mutant'" in line and "'mutants'" in line
    bad = _user_task(tmp_path / "bad.jsonl", [{"query": "q", "choices": ["a", "b"], "gold": 5}])
    assert main(["eval", "--checkpoint", str(init_ckpt), "--tasks", str(bad)]) == 2
    assert "bad.jsonl:1" in one_error_line(capsys)
    assert main(["eval", "--checkpoint", str(init_ckpt), "--tasks", "next_line", "--out", str(out)]) == 2
    assert "results.json" in one_error_line(capsys)
    assert main(["eval", "--checkpoint", str(init_ckpt), "--tasks", "next_line,next_line"]) == 2
    assert "twice" in one_error_line(capsys)
    assert main(["eval", "--checkpoint", str(init_ckpt), "--tasks", "next_line", "--limit", "-1"]) == 2
    assert "--limit" in one_error_line(capsys)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == before
    assert not (tmp_path / "x.json").exists()


def test_score_task_on_a_continuation_task_counts_greedy_matches(tiny_run):
    _, tok = tiny_run
    model = _model(tiny_run, uniform=False)
    items = [Continuation("x = 1\ny = ", "x"), Continuation("import ", "os")]
    r = score_task(model, tok, Task("t", items))
    lls = loglikelihoods(model, tok, [(x.context, x.continuation) for x in items])
    assert r["accuracy"] == sum(g.greedy for g in lls) / 2 and r["baseline"] == 0.0 and r["n"] == 2


# -- the functions task: bodies run in the sandbox, pass@k ------------------------------------------
def test_functions_task_scores_bodies_by_running_them(tiny_run, monkeypatch):
    from lmforge.evals import generation

    _, tok = tiny_run
    prompts = generation.function_prompts(0.02, False, tok, limit=6)
    by_ids = {tuple(tok.render_chat(p.messages, add_generation_prompt=True).ids): p for p in prompts}
    calls = []

    def bodies(model, tok, ids, sampling, runtime, generator=None):
        """The real body on the greedy pass; among samples, every other one is the real body."""
        calls.append(sampling.greedy)
        out = [by_ids[tuple(x)].fields["reference"] if sampling.greedy or i % 2 == 0 else "    return None"
               for i, x in enumerate(ids)]
        return out, [True] * len(ids)

    monkeypatch.setattr(generation, "_bodies", bodies)
    model = _model(tiny_run, uniform=True)
    r = generation.functions_task(model, tok, prompts, samples=4, ks=(1, 2, 4), limit=6)
    assert r["n"] == 6 and r["accuracy"] == 1.0 and r["centred"] == 1.0 and calls == [True, False]
    assert sum(r["checked_by"].values()) == 6 and r["checked_by"]["behaviour"] >= 1
    assert r["sample_pass_rate"] == 0.5 and r["pass@k"] == {"1": 0.5, "2": pytest.approx(pass_at_k(4, 2, 2)),
                                                             "4": 1.0}
    monkeypatch.setattr(generation, "_bodies", lambda m, t, ids, s, rt, generator=None:
                        (["    return None"] * len(ids), [True] * len(ids)))
    assert generation.functions_task(model, tok, prompts, limit=6)["accuracy"] == 0.0
    with pytest.raises(ConfigError, match="1 <= k <= samples"):
        generation.functions_task(model, tok, prompts, samples=2, ks=(5,))


def test_e6_k_above_samples_is_refused_by_the_command(init_ckpt, capsys):
    assert main(["eval", "--checkpoint", str(init_ckpt), "--tasks", "functions", "--samples", "2", "--k", "5"]) == 2
    assert "1 <= k <= samples" in one_error_line(capsys)
    assert main(["eval", "--checkpoint", str(init_ckpt), "--tasks", "functions", "--k", "one"]) == 2
    assert "--k 'one'" in one_error_line(capsys)


# -- periodic evaluation inside training (train.eval_tasks) --------------------------------------------
def test_train_eval_tasks_logs_the_suite_at_each_validation(tiny_run, tmp_path):
    from lmforge.config import load_config
    from lmforge.config.core import EVAL_TASK_NAMES
    from lmforge.stages.pretrain import pretrain_stage

    assert EVAL_TASK_NAMES == (*BUILTIN_TASKS, "builtin")
    cfg, _ = tiny_run
    mine = _user_task(tmp_path / "mine.jsonl", [{"query": "x = ", "choices": ["1", "2"], "gold": 0}] * 3)
    c = replace(cfg, train=replace(cfg.train, steps=4, eval_every=2, eval_tasks=["next_line", str(mine)],
                                   eval_tasks_limit=4))
    pretrain_stage(c, tmp_path / "run", progress=False)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/suite" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert 0 <= r["eval/next_line/accuracy"] <= 1 and r["eval/mine/accuracy"] in (0.0, 0.5, 1.0)
        assert r["eval/suite"] == pytest.approx((r["eval/next_line/centred"] + r["eval/mine/centred"]) / 2)
    with pytest.raises(ConfigError, match="train.eval_tasks names 'functions'"):
        load_config(None, ["train.eval_tasks=[\"functions\"]"])
    bad = _user_task(tmp_path / "bad.jsonl", [{"query": "q", "choices": ["a", "b"]}])
    with pytest.raises(DataError, match="bad.jsonl:1"):
        pretrain_stage(replace(c, train=replace(c.train, eval_tasks=[str(bad)])), tmp_path / "run2", progress=False)
    assert not (tmp_path / "run2" / "metrics.jsonl").exists()  # refused before the first step


def test_an_imported_model_is_evaluated_like_any_checkpoint(tmp_path):
    """A folder transformers saved (SmolLM2's layout, which prepends no BOS: the request starts with
    EOS, lm-eval's prefix token), imported: the same command, the same rule."""
    pytest.importorskip("transformers")
    from hf_families import build_folder

    from lmforge.loading import load_checkpoint
    from lmforge.stages import import_hf_stage

    build_folder("smollm", tmp_path / "hf")
    import_hf_stage(tmp_path / "hf", tmp_path / "imported")
    mine = _user_task(tmp_path / "mine.jsonl", [{"context": "def f(x):\n    return", "continuation": " x"}])
    assert main(["eval", "--checkpoint", str(tmp_path / "imported"), "--tasks", str(mine), "--out",
                 str(tmp_path / "r.json")]) == 0
    got = json.loads((tmp_path / "r.json").read_text())["tasks"]["mine"]
    ours, tok, _, _ = load_checkpoint(tmp_path / "imported")
    ids, split = encode_pair(tok, "def f(x):\n    return", " x")
    assert ids[0] == tok.eos_id and not tok.contract.document_start
    with torch.no_grad():
        logp = torch.log_softmax(ours(torch.tensor([ids])).double(), -1)[0]
    greedy = all(int(logp[t - 1].argmax()) == ids[t] for t in range(split, len(ids)))
    assert got["n"] == 1 and got["accuracy"] == float(greedy)
    want = sum(float(logp[t - 1, ids[t]]) for t in range(split, len(ids)))
    assert loglikelihoods(ours, tok, [("def f(x):\n    return", " x")])[0].logprob == pytest.approx(want, abs=1e-4)
