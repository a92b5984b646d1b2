"""Fine-tuning a user's own model: `lmforge sft` against TRL's `SFTTrainer` with PEFT, side by side.

The model is a `transformers` folder as a user brings it, built here with random weights (nothing is
downloaded): the SmolLM2-135M shape (`LlamaForCausalLM`: hidden 576, 30 layers, 9 query / 3 KV
heads, MLP 1,536, vocabulary 49,152, tied head) with a byte-level BPE of 49,152 tokens trained on
the standard library (`common.stdlib_tokenizer`) and SmolLM2's chat template; or, `--shape
gemma3-270m`, Gemma 3 270M's (`Gemma3ForCausalLM`: hidden 640, 18 layers, five sliding-window layers
to one full, 4 query / 1 KV head of head_dim 256, GeGLU 2,048, a tied head of 262,144 rows) with the
same BPE dressed as Gemma's (`gemma_tokenizer`: Gemma's specials, <bos> prepended, Gemma's chat
template, the vocabulary filled to 262,144 ids with <unusedN> pieces as Gemma's has them, so both
sides carry the real model's 262,144-row head). lmforge reads it with `lmforge import-hf`; TRL
loads it with `AutoModelForCausalLM.from_pretrained`.

The same work on both sides:
- the conversations: the speedrun's SFT set (standard-library functions: a user turn with the
  signature and docstring, the body as the reply; `stdlib_examples`), written as a JSONL of
  messages for lmforge and as TRL's conversational prompt/completion records (the loss on the
  reply only, as lmforge's); the same held-out split (`split_conversations`);
- rows of `--seq-len` tokens, `--batch` rows a step, packed on both sides (lmforge's
  `sft.packing`; TRL's `packing=True`, best-fit decreasing, padding-free with per-sequence
  positions, which transformers turns into block-diagonal attention);
- lmforge's SFT defaults on both sides: `sft.lr` 1e-3, betas 0.9/0.95, weight decay 0.1, clip 1.0,
  10 warm-up steps, the warmup-stable-decay schedule (`sft.schedule = "wsd"`, the last
  `train.decay_fraction` of the steps decaying linearly to lr x `train.min_lr_ratio`; TRL's
  `warmup_stable_decay`), AdamW for the LoRA adapters (lmforge's adapters are on AdamW whatever
  `sft.optimizer` says); full SFT pins `sft.optimizer = "adamw"` (`PINNED_FULL`: TRL has no Muon,
  lmforge's default for the blocks' matrices); the same precision (`precision = "auto"`: bf16
  autocast where the CPU has bf16 units, else float32; TRL's `bf16` likewise). The LoRA arms are
  therefore `lmforge sft` as typed, with only the run's own keys (init, data, rows, steps);
- LoRA: rank 16, alpha 16, no dropout, every linear layer of the blocks (q, k, v, o, gate, up,
  down); full: every weight.

Activation checkpointing: TRL's `SFTConfig` turns it on by default (`gradient_checkpointing=True`:
each decoder layer recomputed in backward), lmforge's `train.activation_checkpointing` is off by
default; the `-ac` arms run lmforge with it on (`--set train.activation_checkpointing=true`), so the
table has lmforge both ways against TRL as it comes.

Each arm is its own process (`--arm`), so its peak resident memory is its own, and the arms
alternate round by round (`--repeat`). Per arm: tokens/s of the optimizer steps after `--warmup`
(real tokens: TRL's padding-free rows have no pad; lmforge's `step_tokens`), the process's peak RSS,
and the held-out loss after the run (nats per reply token, reply tokens summed over the held-out
conversations; each side's own scorer: lmforge's `val_loss`, and for TRL the same sum computed
with the trained model on the rendered conversations).

    python bench/bench_finetune.py [--shape gemma3-270m] [--steps 12] [--warmup 3] [--repeat 1] [--arms ...]
    python bench/bench_finetune.py --smoke     # a tiny Llama, seconds: proves the benchmark runs

Needs `trl` and `peft` (`pip install -e ".[bench]"`; `make bench` installs them); without TRL the
TRL arms are rows saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SMOLLM2_135M = dict(vocab_size=49_152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100_000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)
#: Gemma 3 270M's config.json (google/gemma-3-270m; the GGUF header of the real file agrees:
#: ../shared research, MODEL-FAMILIES 2.2): 18 layers, five sliding (window 512) to one full,
#: head_dim 256 != 640 / 4, GeGLU, embedding x sqrt(640), a tied 262,144-row head (~60% of the
#: FLOPs of a token)
GEMMA3_270M = dict(vocab_size=262_144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                   sliding_window=512, max_position_embeddings=32_768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   hidden_activation="gelu_pytorch_tanh",
                   layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
SMOKE = dict(SMOLLM2_135M, vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
#: six layers: llama.cpp's gemma3 hard-codes the pattern (five sliding, one full), bench_gguf exports it
SMOKE_GEMMA = dict(GEMMA3_270M, vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                   num_attention_heads=2, head_dim=32, query_pre_attn_scalar=32,
                   layer_types=GEMMA3_270M["layer_types"][:6])
#: --shape: the user's model (transformers class, config class, its config, --smoke's) and the
#: token that ends a turn
USER_SHAPES = {"smollm2-135m": ("LlamaForCausalLM", "LlamaConfig", SMOLLM2_135M, SMOKE, "<|im_end|>"),
               "gemma3-270m": ("Gemma3ForCausalLM", "Gemma3TextConfig", GEMMA3_270M, SMOKE_GEMMA, "<end_of_turn>")}
#: the stdlib BPE's specials renamed to Gemma's (ids as lmforge's tokenizer has them)
GEMMA_SPECIALS = {"<|pad|>": "<pad>", "<|bos|>": "<bos>", "<|eos|>": "<eos>", "<|im_start|>": "<start_of_turn>",
                  "<|im_end|>": "<end_of_turn>"}
#: SmolLM2-Instruct's chat template (the public text), with its default system prompt
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LORA_RANK, LORA_ALPHA = 16, 16.0
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ARMS = ("lmforge-lora", "lmforge-lora-ac", "trl-lora", "lmforge-full", "lmforge-full-ac", "trl-full")


#: full SFT: lmforge's default optimizer (Muon for the blocks' matrices, AdamW for the rest) pinned to
#: AdamW, which TRL has (LoRA's adapters are on AdamW either way: nothing pinned)
PINNED_FULL = {"sft.optimizer": "adamw"}
#: lmforge's activation checkpointing, the `-ac` arms (TRL's SFTConfig has it on by default)
RECOMPUTE = {"train.activation_checkpointing": "true"}


def hyper() -> dict:
    """lmforge's SFT defaults (read from its config, so both sides get what lmforge would run)."""
    from lmforge.config import Config

    cfg = Config()
    s, t = cfg.sft, cfg.train
    return {"lr": s.lr, "warmup": s.warmup_steps, "beta1": t.beta1, "beta2": t.beta2, "weight_decay": t.weight_decay,
            "clip": t.grad_clip, "min_lr_ratio": t.min_lr_ratio, "decay_fraction": t.decay_fraction,
            "schedule": s.schedule}


def wsd_kwargs(h: dict, steps: int) -> dict:
    """transformers' `warmup_stable_decay` arguments for lmforge's wsd over `steps` (its decay starts
    at `lmforge.train.schedule.decay_start`, after the warm-up when the two overlap)."""
    from lmforge.train.schedule import decay_start

    start = max(h["warmup"], decay_start(steps, h["decay_fraction"]))
    return {"num_stable_steps": start - min(h["warmup"], steps), "num_decay_steps": max(0, steps - start),
            "decay_type": "linear", "min_lr_ratio": h["min_lr_ratio"]}


def build_user_folder(folder: Path, smoke: bool, shape: str = "smollm2-135m") -> None:
    """A transformers folder of `shape` (random weights, seed 0) with a 49,152-token byte-level BPE
    trained on the standard library: SmolLM2's specials and template, or for Gemma 3 Gemma's
    specials, template and prepended <bos>, its vocabulary filled to 262,144 with <unusedN> pieces
    (as Gemma's has them), so that the head has the real model's rows on both sides."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    arch, config_class, dims, smoke_dims, _ = USER_SHAPES[shape]
    dims = smoke_dims if smoke else dims
    if smoke:
        common.smoke_tokenizer(folder.parent / "smoke-tok", dims["vocab_size"])
        tok_file = folder.parent / "smoke-tok" / "tokenizer.json"
    else:
        common.stdlib_tokenizer(SMOLLM2_135M["vocab_size"])
        tok_file = common.CACHE / f"tokenizer-stdlib-{SMOLLM2_135M['vocab_size']}" / "tokenizer.json"
    if shape == "gemma3-270m":
        tok, kwargs = gemma_tokenizer(tok_file.read_text(), dims["vocab_size"])
    else:  # SmolLM2's document terminator is <|endoftext|>, lmforge's tokenizer calls it <|eos|>; nothing prepended
        from tokenizers import processors

        tok = Tokenizer.from_str(tok_file.read_text().replace('"<|eos|>"', '"<|endoftext|>"'))
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        kwargs = dict(chat_template=SMOLLM2_TEMPLATE, bos_token="<|im_start|>", eos_token="<|im_end|>",
                      pad_token="<|pad|>")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    fast.save_pretrained(str(folder))
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(**dims, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                                              pad_token_id=fast.pad_token_id)
    getattr(transformers, arch)(cfg).save_pretrained(str(folder))


def gemma_tokenizer(text: str, vocab_size: int):
    """lmforge's byte-level BPE (tokenizer.json `text`) dressed as Gemma 3's: its specials renamed
    (GEMMA_SPECIALS), <bos> prepended, <unusedN> pieces up to `vocab_size` ids (plain vocabulary
    entries no merge reaches), Gemma's chat template. Returns (Tokenizer, PreTrainedTokenizerFast kwargs)."""
    from tokenizers import Tokenizer, processors

    from lmforge.export.families.gemma import GEMMA_CHAT_TEMPLATE

    spec = json.loads(text)
    for t in spec["added_tokens"]:
        t["content"] = GEMMA_SPECIALS.get(t["content"], t["content"])
    vocab = {GEMMA_SPECIALS.get(k, k): i for k, i in spec["model"]["vocab"].items()}
    vocab.update({f"<unused{i}>": n for i, n in enumerate(range(len(vocab), vocab_size))})
    spec["model"]["vocab"] = vocab
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    return tok, dict(chat_template=GEMMA_CHAT_TEMPLATE, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                     add_bos_token=True, add_eos_token=False)


def conversations(work: Path, smoke: bool, val_examples: int) -> tuple[list, list]:
    """The SFT set written as a JSONL of messages (lmforge's `sft.data`), and the (train, held-out)
    conversations lmforge's SFT stage takes from that file (`split_conversations`, `cap_examples`)."""
    from lmforge.config import Config
    from lmforge.data.conversations import cap_examples, read_conversations, split_conversations
    from lmforge.data.stdlib_functions import stdlib_examples

    cfg = Config()
    d, s = cfg.data, cfg.sft
    examples = stdlib_examples(d.val_fraction, s.max_chars, 200 if smoke else s.max_examples)
    path = work / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": list(e.conversation().messages)}) + "\n"
                            for e in examples["train"] + examples["val"]))
    split = split_conversations(read_conversations(path), d.val_fraction)  # as the stage reads the file
    return (cap_examples(split["train"], s.max_examples, lambda c: c.key),
            cap_examples(split["val"], val_examples, lambda c: c.key))


def run_lmforge(work: Path, arm: str, a) -> dict:
    from lmforge.cli import main as cli

    out = work / f"{arm}-{os.getpid()}"  # a fresh run folder for every round
    sets = {"sft.init": work / "imported", "tokenizer.dir": work / "imported", "sft.data": work / "chats.jsonl",
            "data.seq_len": a.seq_len, "sft.micro_batch_size": a.batch, "sft.steps": a.steps,
            "sft.val_examples": a.val, "train.checkpoint_every": 0, "train.keep_last": 1, "train.seed": a.seed}
    kind = arm.split("-")[1]
    sets.update({"lora.rank": LORA_RANK, "lora.alpha": LORA_ALPHA} if kind == "lora" else PINNED_FULL)
    if arm.endswith("-ac"):
        sets.update(RECOMPUTE)
    argv = ["sft", "--out", str(out), "--no-progress"]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    code = cli(argv)
    if code:
        raise SystemExit(f"lmforge sft exited {code}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    real = 1.0 - json.loads((out / "sft_data.json").read_text())["padding_fraction"]  # the rows' padding excluded
    start, end = rows[a.warmup - 1] if a.warmup else {"tokens": 0, "elapsed_s": 0.0}, rows[-1]
    # elapsed_s sums the steps' own times (validation excluded): tokens/s of the steps after the warm-up
    tps = real * (end["tokens"] - start["tokens"]) / (end["elapsed_s"] - start["elapsed_s"])
    val = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    return {"tokens_per_s": tps, "val_loss": val[-1], "steps": rows[-1]["step"], "padding": 1.0 - real}


def run_trl(work: Path, arm: str, a, val: list) -> dict:
    import time

    import torch
    import transformers
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from lmforge.runtime import resolve_precision

    h = hyper()
    bf16 = resolve_precision("auto", torch.device("cpu")) == torch.bfloat16
    train = [json.loads(line)["messages"] for line in (work / "train.jsonl").read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": m[:-1], "completion": m[-1:]} for m in train])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(work / "user"), dtype=torch.float32)
    peft_config = None
    if arm.endswith("lora"):
        from peft import LoraConfig
        peft_config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=HF_TARGETS,
                                 task_type="CAUSAL_LM")
    args = SFTConfig(output_dir=str(work / f"{arm}-{os.getpid()}"), max_length=a.seq_len, packing=True, per_device_train_batch_size=a.batch,
                     gradient_accumulation_steps=1, max_steps=a.steps, learning_rate=h["lr"],
                     lr_scheduler_type="warmup_stable_decay", lr_scheduler_kwargs=wsd_kwargs(h, a.steps),
                     warmup_steps=h["warmup"], adam_beta1=h["beta1"], adam_beta2=h["beta2"],
                     weight_decay=h["weight_decay"], max_grad_norm=h["clip"], optim="adamw_torch", bf16=bf16,
                     use_cpu=True, logging_steps=1, save_strategy="no", report_to=[], seed=a.seed,
                     dataloader_num_workers=0, include_num_input_tokens_seen=True, disable_tqdm=True)
    marks: list[tuple[float, int]] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()
            self.seen = state.num_input_tokens_seen

        def on_step_end(self, args, state, control, **kw):
            marks.append((time.perf_counter() - self.t0, state.num_input_tokens_seen - self.seen))

    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, peft_config=peft_config, callbacks=[Clock()])
    trainer.train()
    timed = marks[a.warmup:]
    if not sum(n for _, n in timed):
        raise SystemExit(f"TRL counted no input tokens: {marks}")
    tps = sum(n for _, n in timed) / sum(t for t, _ in timed)
    end = USER_SHAPES[a.shape][-1]
    return {"tokens_per_s": tps, "val_loss": held_out_loss(trainer.model, trainer.processing_class, val, a.seq_len, end),
            "steps": len(marks)}


def held_out_loss(model, tok, val: list, seq_len: int, end_of_turn: str) -> float:
    """Nats per reply token over the held-out conversations: -log p of each reply's tokens (its
    `end_of_turn` token included), summed, over their count (lmforge's val_loss, computed on TRL's model)."""
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for messages in val:
            prompt = tok.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
            full = tok.apply_chat_template(messages, tokenize=False)
            p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
            ids = tok(full, add_special_tokens=False)["input_ids"]
            ids = ids[:seq_len]  # cut as both sides cut a conversation longer than a row
            if len(ids) <= len(p_ids):  # nothing of the reply left (lmforge drops these too)
                continue
            # the reply and its end of turn; the template's trailing newline is not learned
            stop = tok.convert_tokens_to_ids(end_of_turn)
            end = ids.index(stop, len(p_ids)) + 1 if stop in ids[len(p_ids):] else len(ids)
            x = torch.tensor([ids[:end]])
            logp = model(input_ids=x).logits[0, :-1].float().log_softmax(-1)
            target = x[0, 1:]
            lp = logp.gather(1, target[:, None])[:, 0][len(p_ids) - 1:]
            total -= lp.sum().item()
            count += lp.numel()
    return total / count if count else float("nan")


def child(a) -> None:
    """One arm in this process; its result as the last line of stdout (JSON)."""
    work = a.work
    if a.arm.startswith("lmforge"):
        res = run_lmforge(work, a.arm, a)
    else:
        val = [json.loads(line)["messages"] for line in (work / "val.jsonl").read_text().splitlines()]
        res = run_trl(work, a.arm, a, val)
    res["peak_rss_mb"] = common.peak_rss_mb()
    print(json.dumps(res))


def import_user_folder(work: Path, smoke: bool, shape: str = "smollm2-135m") -> None:
    """The user's folder of `shape` (work/user, `build_user_folder`) and `lmforge import-hf` of it
    (work/imported): what both sides of every arm start from."""
    from lmforge.cli import main as cli

    build_user_folder(work / "user", smoke, shape)
    if cli(["import-hf", str(work / "user"), "--out", str(work / "imported")]):
        raise SystemExit("lmforge import-hf failed")


def prepare(work: Path, a) -> None:
    """The user's folder, its import, and the conversations (train and held-out) for both sides."""
    import_user_folder(work, a.smoke, a.shape)
    train, val = conversations(work, a.smoke, a.val)
    for name, convs in (("train", train), ("val", val)):
        (work / f"{name}.jsonl").write_text("".join(json.dumps({"messages": list(c.messages)}) + "\n" for c in convs))


def arm_process(work: Path, arm: str, a) -> dict:
    argv = [sys.executable, __file__, "--arm", arm, "--work", str(work), "--steps", str(a.steps), "--warmup",
            str(a.warmup), "--seq-len", str(a.seq_len), "--batch", str(a.batch), "--val", str(a.val), "--seed",
            str(a.seed), "--shape", a.shape] + (["--smoke"] if a.smoke else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(common.ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(argv, capture_output=True, text=True, env=env)
    if res.returncode:
        return {"failed": f"exit {res.returncode}: {res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ''}",
                "stderr": res.stderr[-3000:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def trl_installed() -> bool:
    try:
        import peft  # noqa: F401
        import trl  # noqa: F401
        return True
    except ImportError:
        return False


def run_rounds(arms: list[str], repeat: int, run_arm) -> dict[str, list[dict]]:
    """Each arm's results over `repeat` rounds, the order reversed every other round (`run_arm(arm)`:
    its result dict); a TRL arm without TRL installed is a result saying so."""
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    have_trl = trl_installed()
    for r in range(repeat):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            if arm.startswith("trl") and not have_trl:
                results[arm].append({"failed": "trl/peft not installed (pip install -e '.[bench]')"})
                continue
            results[arm].append(run_arm(arm))
    return results


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps a run")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of tokens/s")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4, help="packed rows a step")
    ap.add_argument("--val", type=int, default=64, help="held-out conversations scored")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every arm, alternating")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--shape", choices=sorted(USER_SHAPES), default="smollm2-135m",
                    help="the user's model: SmolLM2-135M's shape or Gemma 3 270M's (random weights either way)")
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    common.smoke_flag(ap)
    a = ap.parse_args(argv)
    if a.smoke:  # LoRA's two arms only: every child process imports torch, transformers and TRL
        a.steps, a.warmup, a.seq_len, a.batch, a.val, a.arms = 3, 1, 512, 2, 4, "lmforge-lora,lmforge-lora-ac,trl-lora"
    if a.arm:
        child(a)
        return {}
    arms = [x for x in a.arms.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-finetune-") as tmp:
        work = Path(tmp)
        prepare(work, a)
        results = run_rounds(arms, a.repeat, lambda arm: arm_process(work, arm, a))
    rows = []
    for arm, runs in results.items():
        ok = [x for x in runs if "failed" not in x]
        if not ok:
            rows.append([arm, runs[0]["failed"], "", "", "", ""])
            continue
        tps = statistics.median(x["tokens_per_s"] for x in ok)
        rss = statistics.median(x["peak_rss_mb"] for x in ok)
        loss = statistics.mean(x["val_loss"] for x in ok)
        ref = [x for x in results.get("trl-" + arm.split("-")[1], []) if "failed" not in x]
        ratio = (f"{tps / statistics.median(x['tokens_per_s'] for x in ref):.2f}x / "
                 f"{rss / statistics.median(x['peak_rss_mb'] for x in ref):.2f}x") if ref and arm.startswith("lm") else ""
        rows.append([arm, f"{tps:,.0f}", f"{rss:,.0f}", f"{loss:.4f}", ok[0]["steps"], ratio])
    shape = f"tiny {USER_SHAPES[a.shape][0]} (SMOKE)" if a.smoke else f"{a.shape} shape"
    print(common.table(["arm", "tokens/s", "peak RSS MB", "held-out loss (nats/reply token)", "steps",
                        "lmforge / TRL: tokens/s, memory"], rows,
                       title=f"SFT of a user's {shape}, {a.batch} x {a.seq_len} packed, {a.steps} steps "
                             f"(tokens/s after {a.warmup}); {common.machine_line()}"
                             + (" (SMOKE RUN: figures mean nothing)" if a.smoke else "")))
    return {"results": results, "steps": a.steps, "seq_len": a.seq_len, "batch": a.batch}


if __name__ == "__main__":
    main()
