"""`lmforge rl`: reinforcement learning with verifiable rewards — R1 to R8 of issue 30
(shared/research/RL-EVAL.md §A6), R5 in tests/test_sandbox.py.

R1 the loss and its gradient on hand-computed values (G = 4, rewards [1, 0, 0, 1], one-token
   completions, a 3-token vocabulary), equal rewards give exactly zero gradient, a NaN reward and
   G = 1 are refused, the KL term's gradient has the sign of log pi - log pi_ref
R2 2 gloo ranks = 1 process with twice the accumulation (weights to 1e-6, fp32)
R3 the sampled stop token is inside the loss mask: rewarding an early stop raises p(<|im_end|>)
R4 the sampler's log-probabilities equal the trainer's (fp32, 1e-5)
R6 reward hacking: stubs and hard-coded outputs score 0 on the static reward (and on doctests)
R7 interrupt and --resume: bit-identical metrics and weights
R8 bad input: exit 2, one line naming the field or file
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmforge.config import SamplingConfig
from lmforge.errors import ConfigError, DataError
from lmforge.generate import generate
from lmforge.model import Transformer, load_model, resolve_model_config
from lmforge.model.io import MODEL_FILE, latest_checkpoint
from lmforge.model.loss import group_advantages, policy_gradient_count, policy_gradient_loss, token_logps
from lmforge.scorers.rewards import RewardError
from lmforge.scorers.static import static_reward
from lmforge.stages.rl import rl_stage
from lmforge.train.rl import build_batch
from test_resume import read_metrics, sigterm_at

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/rl_rewards.py: "a user's own" rewards


def prompts_file(path: Path, n: int = 12, **extra) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"def f{i}(x):", "id": i, **extra}) + "\n" for i in range(n)))
    return path


def rl_cfg(cfg, init, data, lora_rank=0, **rl):
    from lmforge.config import LoRAConfig

    base = dict(init=str(init), data=str(data), steps=3, micro_batch_size=2, grad_accum_steps=1, lr=1e-2,
                warmup_steps=0, group_size=4, max_new_tokens=8, rewards=["rl_rewards:short"], val_examples=0)
    base.update(rl)
    return replace(cfg, rl=replace(cfg.rl, **base), data=replace(cfg.data, val_fraction=0.0),
                   train=replace(cfg.train, optimizer="adamw", checkpoint_every=0, keep_last=0, schedule="cosine",
                                 min_lr_ratio=1.0),
                   lora=LoRAConfig(rank=lora_rank, alpha=8.0) if lora_rank else cfg.lora)


# -- R1 ------------------------------------------------------------------------------------------
def test_r1_the_loss_and_its_gradient_on_hand_computed_values():
    G, L, T = 4, 1, 0.7
    z = torch.tensor([[1.0, 2.0, 0.5], [0.0, -1.0, 1.5], [2.0, 2.0, 2.0], [-0.5, 0.3, 0.1]], dtype=torch.float64)
    y = torch.tensor([1, 2, 0, 2])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    A = group_advantages(rewards, G)
    assert A.tolist() == [0.5, -0.5, -0.5, 0.5]
    logits = z.clone().requires_grad_(True)
    lp = token_logps(logits[:, None, :], y[:, None], T)  # (G, 1)
    mask = torch.ones(G, L, dtype=torch.bool)
    num, count = policy_gradient_loss(lp, A, mask, "dr_grpo"), policy_gradient_count(mask, "dr_grpo", L)
    assert count == G * L
    loss = num / count
    assert abs(loss.item() - float(-(A.sum()) / (G * L))) < 1e-12  # the ratio is 1: the value is -sum A / count
    loss.backward()
    p = torch.softmax(z / T, -1)
    onehot = torch.nn.functional.one_hot(y, 3).double()
    want = -(A[:, None] / (G * L)) * (onehot - p) / T
    assert torch.allclose(logits.grad.double(), want, atol=1e-6), (logits.grad, want)
    # the same gradient as -sum A log p (the importance ratio is 1: one step per batch of rollouts)
    ref = z.clone().requires_grad_(True)
    (-(A * token_logps(ref[:, None, :], y[:, None], T)[:, 0].double()).sum() / (G * L)).backward()
    assert torch.allclose(ref.grad, logits.grad.double(), atol=1e-6)
    # the normalisers: DAPO counts completion tokens, GRPO each completion's mean
    lens = torch.tensor([[True, True], [True, False], [True, True], [True, False]])
    lp2 = torch.zeros(G, 2, requires_grad=True)
    assert policy_gradient_count(lens, "dapo", 8) == 6.0
    assert policy_gradient_count(lens, "dr_grpo", 8) == 32.0
    num, c = policy_gradient_loss(lp2, A, lens, "grpo"), policy_gradient_count(lens, "grpo", 8)
    num.backward()
    assert c == 4.0 and torch.allclose(lp2.grad, -(A[:, None] * lens / lens.sum(1, keepdim=True)).float())


def test_r1_equal_rewards_give_exactly_zero_gradient_and_bad_rewards_are_refused():
    A = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]), 3)
    assert A.tolist() == [0.0] * 6
    lp = torch.randn(6, 5, requires_grad=True)
    num = policy_gradient_loss(lp, A, torch.ones(6, 5, dtype=torch.bool), "dr_grpo")
    num.backward()
    assert torch.equal(lp.grad, torch.zeros_like(lp))
    with pytest.raises(ValueError, match="not finite"):
        group_advantages(torch.tensor([1.0, float("nan"), 0.0, 1.0]), 2)
    with pytest.raises(ValueError, match="group_size = 1"):
        group_advantages(torch.tensor([1.0, 0.0]), 1)
    from lmforge.config import load_config

    with pytest.raises(ConfigError, match=r"rl\.group_size = 1: expected 2 <= value"):
        load_config(None, ["rl.group_size=1"])


def test_r1_the_kl_term_pulls_towards_the_reference():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    num = policy_gradient_loss(lp, torch.zeros(1, dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool),
                               "dr_grpo", ref, beta=0.5)
    num.backward()
    # d/dlp of exp(ref - lp) - (ref - lp) - 1 = 1 - exp(ref - lp): the sign of lp - ref
    assert torch.allclose(lp.grad, 0.5 * (1 - torch.exp(ref - lp.detach())))
    assert (torch.sign(lp.grad) == torch.sign(lp.detach() - ref)).all()
    assert num.item() > 0  # k3 >= 0, 0 only at lp == ref


def test_r1_one_rule_for_the_normaliser_and_every_loss_type_is_dispatched():
    """`policy_gradient_count` is the denominator of every `rl.loss_type` (the objective's `count`
    reads it, `policy_gradient_loss` only gives the numerator); another name is refused by both."""
    from lmforge.config import CHOICES

    mask = torch.tensor([[True, True, False], [True, False, False]])
    lp = torch.zeros(2, 3, requires_grad=True)
    for kind in CHOICES["rl.loss_type"]:
        assert policy_gradient_count(mask, kind, 3) > 0
        assert torch.isfinite(policy_gradient_loss(lp, torch.tensor([0.5, -0.5]), mask, kind))
    for call in (lambda: policy_gradient_count(mask, "ppo", 3),
                 lambda: policy_gradient_loss(lp, torch.zeros(2), mask, "ppo")):
        with pytest.raises(ValueError, match=r"loss_type 'ppo': expected one of \('dr_grpo', 'dapo', 'grpo'\)"):
            call()


def test_the_rl_examples_run():
    """The `>>>` examples of `RLObjective` (a step by hand) and of `policy_gradient_count`."""
    import doctest

    import lmforge.model.loss
    import lmforge.train.rl

    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    for module, obj in ((lmforge.train.rl, lmforge.train.rl.RLObjective),
                        (lmforge.model.loss, lmforge.model.loss.policy_gradient_count)):
        for test in finder.find(obj, obj.__name__, globs=vars(module)):
            runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted >= 10 and result.failed == 0, result


def test_step_metrics_divides_each_figure_by_its_denominator():
    """`step_metrics` logs each summed figure as `figures` says: per rollout, per group, per sampled
    token, a reward over the completions it applies to (0 where it met none), counts as ints."""
    from collections import Counter

    from lmforge.train.distributed import DistInfo
    from lmforge.train.rl import DENOMINATORS, RLObjective, figures

    table = figures(["static", "doctests"])
    assert list(table) == sorted(table) and all(table[k] is None for k in DENOMINATORS)
    rl = RLObjective.__new__(RLObjective)
    rl.figures = table
    rl._acc = Counter({"prompts": 2, "rows": 8, "tokens": 20, "row_slots": 40, "pad_slots": 10, "reward": 3.0,
                       "reward_std": 0.8, "mismatch_kl": 0.002, "rewards/static": 3.0, "applies/static": 8.0,
                       "rewards/doctests": 0.0, "applies/doctests": 0.0, "sandbox/PASS": 3.0, "rollout_s": 1.23456})
    out = rl.step_metrics(DistInfo())
    assert out["reward"] == 3 / 8 and out["reward_std"] == 0.4 and out["mismatch_kl"] == 0.002 / 20
    assert out["padding"] == 0.25 and out["rollout_s"] == 1.235 and out["rewards/static"] == 3 / 8
    assert out["rewards/doctests"] == 0.0 and out["sandbox/PASS"] == 3 and isinstance(out["sandbox/PASS"], int)
    assert not set(DENOMINATORS) & set(out) and "pad_slots" not in out
    assert rl._acc == Counter()


def test_r8_the_rl_config_checks_name_the_field(tiny_run):
    """`config.check_rl`: the [rl] section against [lora] and [data], before an rl run touches anything."""
    from lmforge.config import LoRAConfig, check_rl

    cfg, _ = tiny_run
    ok = replace(cfg, rl=replace(cfg.rl, init="runs/sft", max_new_tokens=8))
    assert check_rl(ok) is ok
    with pytest.raises(ConfigError, match=r"rl\.init is empty: set the checkpoint to train"):
        check_rl(replace(ok, rl=replace(ok.rl, init="")))
    with pytest.raises(ConfigError, match=r"lora\.dropout = 0\.1: the loss must differentiate .* lora\.dropout = 0"):
        check_rl(replace(ok, lora=LoRAConfig(rank=4, dropout=0.1)))
    assert check_rl(replace(ok, lora=LoRAConfig(rank=0, dropout=0.1)))  # no adapters: no dropout applies
    with pytest.raises(ConfigError, match=r"rl\.max_new_tokens = 64 leaves no room for a prompt in data\.seq_len = 64"):
        check_rl(replace(ok, rl=replace(ok.rl, max_new_tokens=64)))


# -- R3, R4 ------------------------------------------------------------------------------------------
def _model(tiny_run):
    cfg, tok = tiny_run
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    model.reset_parameters(seed=1)
    return model, tok


def test_r4_the_sampler_and_the_trainer_agree(tiny_run):
    model, tok = _model(tiny_run)
    prompts = [tok.render_chat([{"role": "user", "content": f"def g{i}(x):"}], add_generation_prompt=True).ids
               for i in range(3)]
    T = 0.7
    sampling = SamplingConfig(max_new_tokens=12, temperature=T, top_k=0, top_p=1.0, repetition_penalty=1.0)
    ids, logps = generate(model, prompts, [tok.im_end_id, tok.eos_id], sampling, tok.pad_id,
                          generator=torch.Generator().manual_seed(0), return_logprobs=True)
    assert [len(a) for a in ids] == [len(b) for b in logps] and all(ids)
    batch = build_batch(prompts, ids, logps, torch.zeros(3), torch.zeros(3), tok.pad_id)
    with torch.no_grad():
        lp = token_logps(model(batch.tokens, batch.positions), batch.targets, T)
    m = batch.loss_mask
    assert int(m.sum()) == sum(map(len, ids))
    assert (batch.sampler_logps[m] - lp[m]).abs().max().item() < 1e-5
    assert torch.equal(batch.targets[m], torch.tensor([t for row in ids for t in row]))


def test_r3_the_stop_token_is_trained(tiny_run):
    """A completion that stops early (its <|im_end|> sampled) is rewarded: one step raises
    p(<|im_end|>) at the position where it was sampled — the stop token is inside the mask."""
    model, tok = _model(tiny_run)
    prompt = tok.render_chat([{"role": "user", "content": "def stop(x):"}], add_generation_prompt=True).ids
    body = tok.encode(" return x")
    completions = [body + [tok.im_end_id], body + tok.encode(" + 1 and more"), body + [tok.im_end_id],
                   body + tok.encode(" * 2 and more")]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    A = group_advantages(rewards, 4)
    batch = build_batch([prompt] * 4, completions, [[0.0] * len(c) for c in completions], A, rewards, tok.pad_id)
    at = len(prompt) - 1 + len(body)  # the position that predicts the stop token
    assert batch.loss_mask[0, at] and batch.targets[0, at] == tok.im_end_id

    def p_stop():
        with torch.no_grad():
            return torch.softmax(model(batch.tokens, batch.positions)[0, at].float(), -1)[tok.im_end_id].item()

    before = p_stop()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    num = policy_gradient_loss(token_logps(model(batch.tokens, batch.positions), batch.targets), A,
                               batch.loss_mask, "dr_grpo")
    (num / policy_gradient_count(batch.loss_mask, "dr_grpo", 16)).backward()
    opt.step()
    assert p_stop() > before * 1.05, (before, p_stop())


# -- R6 -------------------------------------------------------------------------------------------
SIG = 'def IS_CHARACTER_JUNK(ch, ws=" \\t"):'
HACKS = ["    pass", "    ...", "    return None", "    raise NotImplementedError", '    """Junk."""',
         "    return True", "    if ch == ' ':\n        return True\n    if ch == 'x':\n        return False\n    return True",
         "    return ch in wz", "    return (\n"]


@pytest.mark.parametrize("body", HACKS)
def test_r6_stubs_and_hard_coded_outputs_score_zero(body):
    assert static_reward(SIG, body, True, "difflib") == 0.0
    from lmforge.scorers import run_doctests

    if body != "    return (\n":
        assert run_doctests("difflib", "IS_CHARACTER_JUNK", SIG + "\n" + body + "\n") != "PASS" or \
            static_reward(SIG, body, True, "difflib") == 0.0


def test_r6_a_real_body_scores_one_and_a_cut_off_one_zero():
    assert static_reward(SIG, "    return ch in ws", True, "difflib") == 1.0
    assert static_reward(SIG, "    return ch in ws", False, "difflib") == 0.0


# -- the stage: R2, R7, end to end -----------------------------------------------------------------
def test_rl_trains_on_a_users_reward_and_its_checkpoint_loads(tiny_run, init_ckpt, tmp_path):
    cfg, _ = tiny_run
    c = rl_cfg(cfg, init_ckpt, prompts_file(tmp_path / "p.jsonl"), steps=4, val_examples=4)
    c = replace(c, data=replace(c.data, val_fraction=0.3))
    last = rl_stage(c, tmp_path / "rl", progress=False)
    rows = read_metrics(tmp_path / "rl")
    steps = [r for r in rows if "reward" in r]
    assert len(steps) == 4 and last["step"] == 4
    for r in steps:
        assert 0 <= r["reward"] <= 1 and 0 <= r["frac_reward_zero_std"] <= 1 and r["rollout_s"] > 0
        assert r["completions/clipped_ratio"] + r["stop_rate"] == pytest.approx(1.0)
        assert abs(r["mismatch_kl"]) < 1e-4  # fp32 both sides
    assert "val_reward" in last and last["val_n"] >= 1 and 0 <= last["val_static_lo"] <= last["val_static_hi"] <= 1
    data = json.loads((tmp_path / "rl" / "rl_data.json").read_text())
    assert data["prompts"]["train"] + data["prompts"]["val"] == 12 and data["group_size"] == 4
    model = load_model(tmp_path / "rl")[0]
    assert isinstance(model, Transformer)


def test_r7_rl_resume_is_exact(tiny_run, init_ckpt, tmp_path, monkeypatch):
    cfg, _ = tiny_run
    c = rl_cfg(cfg, init_ckpt, prompts_file(tmp_path / "p.jsonl"), steps=5)
    rl_stage(c, tmp_path / "straight", progress=False)
    with monkeypatch.context() as m:
        sigterm_at(m, 2)
        last = rl_stage(c, tmp_path / "resumed", progress=False)
    assert last["step"] == 2 and last.get("interrupted")
    rl_stage(c, tmp_path / "resumed", resume=True, progress=False)
    skip = ("tokens_per_s", "elapsed_s", "rollout_s")
    a = [{k: v for k, v in r.items() if k not in skip} for r in read_metrics(tmp_path / "straight")]
    b = [{k: v for k, v in r.items() if k not in skip} for r in read_metrics(tmp_path / "resumed")]
    assert a == b
    wa = load_file(str(latest_checkpoint(tmp_path / "straight") / MODEL_FILE))
    wb = load_file(str(latest_checkpoint(tmp_path / "resumed") / MODEL_FILE))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(r["reward"] not in (0.0, 1.0) for r in a if "reward" in r)  # the rewards vary: a real test
    with pytest.raises(Exception, match="rl.group_size"):
        rl_stage(replace(c, rl=replace(c.rl, group_size=2, steps=8)), tmp_path / "resumed", resume=True,
                 progress=False)


def test_r2_two_ranks_equal_one_process_with_twice_the_accumulation(tiny_run, init_ckpt, tmp_path):
    from test_distributed import run_ranks

    cfg, _ = tiny_run
    data = prompts_file(tmp_path / "p.jsonl")
    run_ranks(2, [{"cfg": rl_cfg(cfg, init_ckpt, data, micro_batch_size=1, grad_accum_steps=1),
                   "out": tmp_path / "two", "stage": "rl"}])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks
    try:
        rl_stage(rl_cfg(cfg, init_ckpt, data, micro_batch_size=1, grad_accum_steps=2), tmp_path / "one",
                 progress=False)
    finally:
        torch.set_num_threads(threads)
    a, b = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
    for x, y in zip(a, b):
        for key in ("loss", "reward", "reward_std", "completions/mean_length", "grad_norm"):
            assert abs(x[key] - y[key]) < 1e-6, (key, x, y)
    wa = load_file(str(latest_checkpoint(tmp_path / "two") / MODEL_FILE))
    wb = load_file(str(latest_checkpoint(tmp_path / "one") / MODEL_FILE))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-6


def test_rl_with_lora_and_a_kl_term_trains_only_the_adapters(tiny_run, init_ckpt, tmp_path):
    from lmforge.model import lora

    cfg, _ = tiny_run
    rl_stage(rl_cfg(cfg, init_ckpt, prompts_file(tmp_path / "p.jsonl"), lora_rank=4, beta=0.1, steps=2),
             tmp_path / "rl", progress=False)
    weights = load_file(str(latest_checkpoint(tmp_path / "rl") / MODEL_FILE))
    assert all(lora.is_adapter_key(k) for k in weights)
    assert not lora.has_adapters(load_model(tmp_path / "rl")[0])


# -- R8 -------------------------------------------------------------------------------------------
def test_r8_bad_input_is_refused_naming_the_field_or_file(tiny_run, init_ckpt, tmp_path):
    cfg, _ = tiny_run
    data = prompts_file(tmp_path / "p.jsonl")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "word " * 200}) + "\n")
    with pytest.raises(DataError, match=r"long\.jsonl:1: the prompt is \d+ tokens"):
        rl_stage(rl_cfg(cfg, init_ckpt, long), tmp_path / "a", progress=False)
    with pytest.raises(RewardError, match=r"rl\.rewards = 'rl_rewards:raises' raised KeyError"):
        rl_stage(rl_cfg(cfg, init_ckpt, data, rewards=["rl_rewards:raises"]), tmp_path / "b", progress=False)
    with pytest.raises(RewardError, match=r"returned 'yes' for completion 0"):
        rl_stage(rl_cfg(cfg, init_ckpt, data, rewards=["rl_rewards:not_numbers"]), tmp_path / "c", progress=False)
    with pytest.raises(RewardError, match=r"returned list of 1: expected a list of 2 numbers"):
        rl_stage(rl_cfg(cfg, init_ckpt, data, rewards=["rl_rewards:too_few"]), tmp_path / "d", progress=False)
    with pytest.raises(ConfigError, match=r"rl\.rewards = 'no_such_module_x:f': cannot import"):
        rl_stage(rl_cfg(cfg, init_ckpt, data, rewards=["no_such_module_x:f"]), tmp_path / "e", progress=False)
    with pytest.raises(RewardError, match=r"reads the field\(s\) \['signature'\]"):
        rl_stage(rl_cfg(cfg, init_ckpt, data, rewards=["static"]), tmp_path / "f", progress=False)
    with pytest.raises(ConfigError, match="rl.init is empty"):
        rl_stage(replace(cfg, rl=replace(cfg.rl, init="")), tmp_path / "g", progress=False)
    for p in "abcdefg":
        assert not (tmp_path / p / "metrics.jsonl").exists()


@pytest.mark.parametrize("sets,message", [
    (["rl.beta=-0.1"], r"rl\.beta = -0\.1: expected 0\.0 <= value"),
    (["rl.group_size=0"], r"rl\.group_size = 0"),
    (["rl.rewards=[]"], r"rl\.rewards is empty"),
    (["rl.rewards=['static', 'static']"], r"a reward appears twice"),
    (["rl.rewards=['nonsense']"], r"rl\.rewards names 'nonsense'"),
    (["rl.loss_type=ppo"], r"rl\.loss_type = 'ppo' is not one of"),
    (["rl.temperature=0"], r"rl\.temperature = 0\.0: expected 0\.0 < value"),
])
def test_r8_bad_settings_exit_2_with_one_line(sets, message, capsys):
    from lmforge.cli import main

    argv = ["rl", "--out", "nowhere"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and re.search(message, err[0]), err


def test_wilson_interval():
    from lmforge.scorers.intervals import wilson_interval

    lo, hi = wilson_interval(8, 20)
    assert math.isclose(lo, 0.2188, abs_tol=1e-4) and math.isclose(hi, 0.6134, abs_tol=1e-4)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(0, 0) == (0.0, 1.0)


def test_the_health_monitor_reads_rewards_not_the_loss_of_rl():
    from lmforge.train.health import EQUAL_RUN, RL_WINDOW, HealthMonitor

    h = HealthMonitor(200)
    fired = []
    for s in range(1, 3 * RL_WINDOW + 1):  # an RL loss near 0 that flips sign: no loss warning
        fired += h.update({"step": s, "loss": 0.05 * (-1) ** s, "grad_norm": 1.0, "lr": 1e-3, "reward": 0.25,
                           "frac_reward_zero_std": 1.0 if s <= EQUAL_RUN else 0.5})
    kinds = [(w.kind, w.step) for w in fired]
    assert kinds == [("all_groups_equal", EQUAL_RUN), ("reward_stalled", 3 * RL_WINDOW)], kinds
    h = HealthMonitor(200)
    rising = [w for s in range(1, 3 * RL_WINDOW + 1)
              for w in h.update({"step": s, "loss": 0.0, "grad_norm": 1.0, "lr": 1e-3, "reward": s / 100,
                                 "frac_reward_zero_std": 0.0})]
    assert rising == []


def test_an_rl_checkpoint_is_taken_by_generate_eval_and_every_export(tiny_run, init_ckpt, tmp_path):
    from lmforge.stages import eval_stage, export_stage, generate_stage

    cfg, _ = tiny_run
    rl_stage(rl_cfg(cfg, init_ckpt, prompts_file(tmp_path / "p.jsonl"), lora_rank=4, steps=2), tmp_path / "rl",
             progress=False)
    text = generate_stage(cfg, tmp_path / "rl", "def f(x):", replace(cfg.generate, max_new_tokens=4, greedy=True))
    assert isinstance(text, str)
    result = eval_stage(tmp_path / "rl", cfg.data.dir)
    assert all(math.isfinite(v) for v in result.values() if isinstance(v, float))
    export_stage(tmp_path / "rl", tmp_path / "hf", fmt="hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    export_stage(tmp_path / "rl", tmp_path / "m.gguf", fmt="gguf")
    assert (tmp_path / "m.gguf").read_bytes()[:4] == b"GGUF"
    export_stage(tmp_path / "rl", tmp_path / "peft", fmt="peft")
    assert (tmp_path / "peft" / "adapter_model.safetensors").is_file()


def test_rl_dry_run_makes_a_rollout_and_writes_nothing(tiny_run, init_ckpt, tmp_path, capsys):
    cfg, _ = tiny_run
    res = rl_stage(rl_cfg(cfg, init_ckpt, prompts_file(tmp_path / "p.jsonl")), tmp_path / "dry", dry_run=True,
                   progress=False)
    assert not (tmp_path / "dry").exists()
    assert "plan" in res and "plan: memory per rank" in capsys.readouterr().err


def test_the_doctests_reward_logs_the_same_figures_on_every_step(tiny_run, init_ckpt, tmp_path):
    """Every step's row has the same keys (each rank reduces the same list, whatever its rollouts met),
    the sandbox's verdict counts included when a reward runs code."""
    cfg, _ = tiny_run
    sig = 'def IS_CHARACTER_JUNK(ch, ws=" \\t"):'
    data = prompts_file(tmp_path / "p.jsonl", n=4, module="difflib", qualname="IS_CHARACTER_JUNK", signature=sig,
                        reference="    return ch in ws")
    c = rl_cfg(cfg, init_ckpt, data, rewards=["static", "doctests", "behaviour"], steps=2, val_examples=4)
    last = rl_stage(replace(c, data=replace(c.data, val_fraction=0.5)), tmp_path / "rl", progress=False)
    n = last["val_behaviour_n"]  # every held-out prompt is a function the behaviour cases cover
    assert n == last["val_n"] >= 1 and last["val_behaviour_lo"] <= last["val_behaviour"] <= last["val_behaviour_hi"]
    rows = [r for r in read_metrics(tmp_path / "rl") if "reward" in r]
    keys = [{k for k in r if not k.startswith("val_")} for r in rows]
    assert len(rows) == 2 and keys[0] == keys[1]
    assert {"rewards/static", "rewards/doctests", "rewards/behaviour", "sandbox/PASS", "sandbox/ERROR"} <= rows[0].keys()
    assert all(r["sandbox/ERROR"] == 0 and r["applies/behaviour"] == 1.0 for r in rows)


def test_packed_rollouts_give_each_rollout_the_logps_and_gradient_it_has_alone(tiny_run):
    """rl.packing: rollouts of different lengths packed into fewer rows give every rollout's
    token log-probabilities (and the gradient of the loss) that its own right-padded row gives;
    the layout is deterministic and pads less."""
    from lmforge.model.loss import policy_gradient_loss

    model, tok = _model(tiny_run)
    gen = torch.Generator().manual_seed(3)
    prompts = [list(torch.randint(5, 200, (int(n),), generator=gen)) for n in (5, 9, 3, 12, 7, 4)]
    completions = [list(torch.randint(5, 200, (int(n),), generator=gen)) for n in (2, 6, 1, 9, 3, 5)]
    logps = [[0.0] * len(c) for c in completions]
    adv, rew = torch.randn(6, generator=gen, dtype=torch.float64), torch.zeros(6)
    padded = build_batch(prompts, completions, logps, adv, rew, tok.pad_id)
    packed = build_batch(prompts, completions, logps, adv, rew, tok.pad_id, packing=True)
    again = build_batch(prompts, completions, logps, adv, rew, tok.pad_id, packing=True)
    assert torch.equal(packed.rows.tokens, again.rows.tokens) and torch.equal(packed.unpack, again.unpack)
    assert packed.rows.tokens.shape[0] < 6 and packed.slots[0] < padded.slots[0]
    assert packed.slots[1] - packed.slots[0] == padded.slots[1] - padded.slots[0]  # the same real positions
    grads = []
    for b in (padded, packed):
        model.zero_grad()
        lp = b.logps(model, 0.7)
        m = b.loss_mask
        num = policy_gradient_loss(lp, b.advantages, m, "grpo")
        num.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if b is padded:
            ref = lp.detach()
        else:
            assert (lp.detach()[m] - ref[m]).abs().max().item() < 1e-5
    for n in grads[0]:
        assert (grads[0][n] - grads[1][n]).abs().max().item() < 1e-5, n


def test_packed_and_padded_rl_runs_take_the_same_steps(tiny_run, init_ckpt, tmp_path):
    """rl.packing changes the rows of the forward, not the training: the same rollouts, rewards,
    loss and weights step after step (float tolerance), with less padding logged."""
    cfg, _ = tiny_run
    data = tmp_path / "p.jsonl"  # prompts of very different lengths: two short rollouts (~18 + 8 tokens) fit in
    # the width of a long one (~50 + 8), whatever the completions' lengths
    data.write_text("".join(json.dumps({"prompt": f"f{i}" if i % 2 else
                                        f"def f{i}(x):\n    \"\"\"{'Return x. ' * 3}\"\"\"", "id": i}) + "\n"
                            for i in range(12)))
    runs = {}
    for packing in (False, True):
        rl_stage(rl_cfg(cfg, init_ckpt, data, packing=packing), tmp_path / str(packing), progress=False)
        runs[packing] = read_metrics(tmp_path / str(packing))
    a, b = runs[False], runs[True]
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        for key in ("reward", "completions/mean_length"):
            assert x[key] == y[key], key
        for key in ("loss", "grad_norm", "mismatch_kl"):
            assert abs(x[key] - y[key]) < 1e-5, (key, x[key], y[key])
        assert y["padding"] <= x["padding"]
    assert any(y["padding"] < x["padding"] for x, y in zip(a, b)), [(x["padding"], y["padding"]) for x, y in zip(a, b)]
    wa = load_file(str(latest_checkpoint(tmp_path / "False") / MODEL_FILE))
    wb = load_file(str(latest_checkpoint(tmp_path / "True") / MODEL_FILE))
    # three AdamW steps at lr 1e-2 move a weight by up to ~3e-2; Adam's division by sqrt(v) carries the
    # float32 rounding of the two row layouts' sums into the weights at ~1e-5 (6e-6 and 1.3e-5 seen
    # with two formulas of the same softmax): equal to 1e-3 of the update, not to the last bits
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 5e-5


@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_fused_token_logps_equal_log_softmax_of_the_logits_with_their_gradients(softcap):
    """RL's log-probabilities through the fused loss (one group per position: no (R, T, V) logits)
    equal `token_logps` of the model's logits at the sampler's temperature, values and gradients;
    a position without a target (negative) reads 0."""
    from lmforge.config import ModelConfig
    from lmforge.model import Transformer
    from lmforge.train.rl import fused_token_logps

    m = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=90, max_seq_len=32,
                                final_softcap=softcap))
    m.reset_parameters(seed=3)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 90, (3, 12), generator=g)
    targets = torch.roll(tokens, -1, 1)
    targets[0, :4] = -1
    positions = torch.arange(12).expand(3, 12)
    T = 0.7
    fused = fused_token_logps(m, tokens, positions, None, targets, T)
    gf = torch.autograd.grad(fused[targets >= 0].sum(), list(m.parameters()))
    ref = token_logps(m(tokens, positions), targets, T)
    gr = torch.autograd.grad(ref[targets >= 0].sum(), list(m.parameters()))
    torch.testing.assert_close(fused[targets >= 0], ref[targets >= 0], rtol=1e-5, atol=1e-5)
    assert bool((fused[targets < 0] == 0).all())
    for a, b in zip(gf, gr):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
