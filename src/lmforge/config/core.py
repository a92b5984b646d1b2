"""The sections every run reads: [tokenizer], [data], [model], [train]. Each field declares its
range or choices and its `--resume` rule once (lmforge.config.fields); its docstring is its help."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmforge.config.sources import DEDUP, check_executor, check_filters, check_sources
from lmforge.config.fields import BOTH, PRE, TUNE, allowed, choice, flag, items, num, refused, table, text
from lmforge.errors import ConfigError

#: The most tokens one optimizer step may take on one data-parallel rank (micro-batch x accumulation
#: x seq_len; the global batch x seq_len for an automatic micro-batch).
MAX_TOKENS_PER_STEP = 1 << 30
#: The largest tokenizer vocabulary lmforge trains or accepts (Gemma's is 256K; the BPE
#: trainer aborts the process on sizes near 2^31).
MAX_VOCAB = 1 << 22
#: The most optimizer steps any count of steps may name (train.steps, warmup, checkpoint_every, ...):
#: a hundred million, far beyond any run, so a slipped digit is caught before any work.
MAX_STEPS = 10**8
#: The longest sequence a model or a row may have (16M tokens).
MAX_SEQ_LEN = 1 << 24
#: train.micro_batch_size = "auto", as stored.
AUTO_MICRO_BATCH = 0

# -- why a change is refused, or safe, under --resume (lmforge.train.resume) -----------------------
ARCH = refused(BOTH, "a different [model] section is another architecture than the saved weights and optimizer state")
SCHEDULE = ("shapes the learning-rate schedule: refused when it changes the learning rate of a step already "
            "taken, allowed when it only moves what is still ahead (e.g. more steps while a wsd run has not "
            "begun its decay)")
ACCUM = ("the rows of every optimizer step: compared as accumulation x data-parallel ranks, so a run continued "
         "on another number of ranks keeps its global batch (up to the float order of the sums)")
_OWN = "SFT and DPO train with their own section's value and compare that (sft.{key}, dpo.{key})"
#: train.schedule's choices (lmforge.train.schedule.lr_at dispatches on them).
SCHEDULES = ("cosine", "wsd", "constant")
#: train.optimizer's choices (lmforge.train.optim builds them).
OPTIMIZERS = ("adamw", "muon")
_OPT = refused(BOTH, "an optimizer setting applied at every step, the steps taken included")


def _muon(cfg) -> bool:
    return cfg.train.optimizer == "muon"


def _stdlib_tune(cfg) -> bool:
    return cfg.sft.data == "stdlib" or cfg.dpo.data == "stdlib"


_MUON = refused(BOTH, _OPT.why, "AdamW runs (train.optimizer = 'adamw') do not read it", when=_muon)


@dataclass
class TokenizerConfig:
    vocab_size: int = num(4096, 1, MAX_VOCAB, allowed(
        "read by train-tokenizer only; the tokenizer itself is compared through its contract (sha256, special ids), "
        "which --resume checks first"))
    """Tokenizer vocabulary size, special tokens included (4096: best bits per byte per CPU
    minute for the default model, bench/RESULTS.md)."""
    dir: str = text("runs/tokenizer", allowed(
        "the tokenizer in that folder is compared through its contract, which --resume checks first; the same "
        "tokenizer in another folder is the same tokenizer"), nonempty=True)
    """Folder of the trained tokenizer (tokenizer.json, tokenizer_config.json, contract.json)."""
    max_train_bytes: int = num(0, 0, 1 << 50, allowed("read by train-tokenizer only"))  # 1 PiB of text
    """Train the BPE on at most this many bytes of text (0 = all)."""
    eos_token: str = text("", allowed("read by import-hf / import-tokenizer only; the contract they wrote is compared"))
    """import-tokenizer / import-hf: the token that ends a document, for a tokenizer whose
    eos_token ends a chat turn and whose vocabulary has no known document terminator ("" =
    derived: the declared eos_token, or <|endoftext|>, <|end_of_text|>, </s>, <eos>)."""


@dataclass
class DataConfig:
    source: str = text("stdlib", allowed(
        "read by prepare only: pretraining reads the shards in data.dir, SFT and DPO read sft.data and dpo.data"),
        nonempty=True)
    """"stdlib" (the running interpreter's standard library); a folder of .txt/.md/.py files
    and record shards (.jsonl, .jsonl.gz, .jsonl.zst, .parquet); a glob of such files
    ("corpus/*.parquet", "shards/**/*.jsonl.zst"); one such file; a folder written by
    `datasets`' `save_to_disk`; or "hf:OWNER/NAME[@REVISION][:PATH]", a dataset already in the local
    Hugging Face cache (never downloaded: `hf download OWNER/NAME --repo-type dataset` first; PATH a
    subfolder or glob inside it). Records give their `data.text_field`. Files are read in sorted
    path order (a save_to_disk folder: its own order)."""
    text_field: str = text("text", allowed("read by prepare only (the documents are in the shards)"), nonempty=True)
    """The field (JSONL) or column (Parquet, Arrow) of a record that holds its text."""
    sources: list[dict] = items((), refused(
        PRE, "which source each training row is drawn from (the rows' order and proportions)",
        "SFT and DPO do not read it"), check=check_sources)
    """A weighted mixture instead of data.source: a list of tables {source, weight = 1,
    text_field = "text", name}, each `source` anything data.source takes. `lmforge prepare`
    prepares each into data.dir/NAME once (a source already prepared with the same files and
    settings is reused, whatever the weights); pretraining draws its rows from the sources in
    proportion to `weight`, deterministically (lmforge.data.mixture). [] = data.source alone."""
    dir: str = text("runs/data", refused(PRE, "the shards the rows come from", "SFT and DPO do not read it",
                                         path=True), nonempty=True)
    """Folder of the prepared shards ({split}.bin, {split}.idx, contract.json)."""
    seq_len: int = num(256, 1, MAX_SEQ_LEN, refused(
        BOTH, "the length of every row, so which tokens share a row and the data position"))
    """Tokens per training row."""
    document_masking: bool = flag(True, refused(
        PRE, "the attention mask and positions of every row",
        "SFT and DPO do not read it (sft.packing and dpo.packing decide)"))
    """Attend only within a document (block-diagonal causal mask) and reset positions."""
    val_fraction: float = num(0.02, 0.0, 1.0, refused(
        TUNE, "which conversations (or pairs) are trained on",
        "pretraining: read by prepare only (the split is in the shards)"), high_open=True)
    """Fraction of documents (by module / file / record hash) held out for validation."""
    include_tests: bool = flag(False, refused(
        TUNE, "which standard-library functions are trained on",
        "pretraining: read by prepare only; SFT and DPO on a file do not read it", when=_stdlib_tune))
    """stdlib only: keep `test`/`tests` folders (excluded by default)."""
    on_bad_utf8: str = choice("skip", ("skip", "error"), allowed("read by prepare only"))
    """A file that is not UTF-8: "skip" (counted and reported) or "error"."""
    workers: int = num(0, 0, 1024, allowed("read by prepare only (the shards are the same for any number)"))
    """Tasks `lmforge prepare` runs at once (datatrove's local executor, lmforge.data.parallel),
    each on its share of the one stream of records; 0 = the machine's cores, 1 = one process (no
    executor). The data folder is the same to the byte for any number; a stopped prepare
    resumes with the tasks it had not finished."""
    executor: dict = table(allowed("read by prepare --executor slurm|ray only"),
                           check=check_executor)
    """`lmforge prepare --executor slurm|ray`'s options (datatrove's executors): `tasks` (default
    data.workers, else 64 on Slurm, the cores on Ray); Slurm: `partition` (required), `time`
    ("HH:MM:SS", default "04:00:00"), `cpus_per_task` (2), `mem_per_cpu_gb` (2), `qos` (""),
    `venv_path` (a venv's activate script sourced first), each stage a job array, the last job
    writing data.dir; Ray: `address` (a running cluster; default: one started on this machine)."""
    filters: list[str] = items((), allowed("read by prepare only (the documents kept are in the shards)"),
                               check=check_filters)
    """datatrove's quality filters every document goes through, in order (lmforge.data.quality):
    "gopher_quality", "gopher_repetition", "c4_quality", "fineweb_quality"; what each removed
    (documents, bytes, names) in report.json. Tuned for English prose: code fails them. Needs
    the `filters` extra (spaCy's word tokenizer; no download). [] = no filter."""
    dedup: str = choice("exact", DEDUP, allowed("read by prepare only (the documents kept are in the shards)"))
    """"exact": a document whose text equals an earlier one's is dropped; "minhash": near-duplicates
    too (datatrove's MinHash stages, word 5-grams: Jaccard 0.8 found 92% of the time), the first in
    the stream kept, the same folder at any data.workers; needs the `filters` extra."""



#: model.layer_types' entries.
LAYER_TYPES = ("full", "sliding")


def _check_layer_types(name: str, value) -> None:
    if not isinstance(value, list) or any(t not in LAYER_TYPES for t in value):
        raise ConfigError(f"{name} = {value!r}: expected a list of {' / '.join(map(repr, LAYER_TYPES))}, one per "
                          f"layer, or [] (every layer full).")


def _check_layer_indices(name: str, value) -> None:
    if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in value) \
            or len(set(value)) != len(value):
        raise ConfigError(f"{name} = {value!r}: expected a list of distinct layer indices (integers >= 0).")


@dataclass
class ModelConfig:
    dim: int = num(256, 1, 1 << 16, ARCH)  # Llama 3 405B: 16384
    n_layers: int = num(4, 1, 1024, ARCH)  # Llama 3 405B: 126
    n_heads: int = num(4, 1, 1 << 12, ARCH)
    """Query heads (head_dim = dim / n_heads unless model.head_dim is set). The recipe's 4 (head_dim 64) against 8 (head_dim 32):
    -0.066 bits/byte at equal wall clock (mean of 3 seeds, every seed lower), 13-15% faster steps
    (bench/RESULTS.md)."""
    n_kv_heads: int = num(2, 1, 1 << 12, ARCH)
    vocab_size: int = num(0, 0, MAX_VOCAB, ARCH)
    """0 = derived from the tokenizer's contract (always, in practice). A value set by
    hand must be at least the tokenizer's vocab size; it is rounded up to a multiple of 64."""
    ffn_dim: int = num(0, 0, 1 << 20, ARCH)
    """0 = derived: 8/3 * dim rounded up to a multiple of 64 (Llama's SwiGLU rule)."""
    norm_eps: float = num(1e-5, 0.0, 1.0, ARCH, low_open=True)
    rope_theta: float = num(10000.0, 1.0, 1e12, ARCH, low_open=True)
    """Llama 3: 5e5; long-context models up to ~1e8; <= 1 would give no spread of rotations."""
    max_seq_len: int = num(2048, 1, MAX_SEQ_LEN, ARCH)
    tie_embeddings: bool = flag(False, ARCH)
    qk_norm: bool = flag(True, ARCH)
    """RMSNorm over each head's q and k before the rotary embedding (Qwen3's layout; exported
    as Qwen3ForCausalLM)."""
    qkv_bias: bool = flag(False, ARCH)
    """Biases on the q, k and v projections (Qwen2's layout; imported models only)."""
    rope_scaling: str = choice("none", ("none", "llama3"), ARCH)
    """"none" (plain RoPE) or "llama3" (Llama 3.1's frequency scaling, the four rope_* keys
    below; imported models only)."""
    rope_factor: float = num(8.0, 1.0, 1e6, ARCH)  # Llama 3.1: 8; 1 = no stretch
    rope_low_freq_factor: float = num(1.0, 0.0, 1e6, ARCH, low_open=True)  # Llama 3.1: 1
    rope_high_freq_factor: float = num(4.0, 0.0, 1e6, ARCH, low_open=True)  # Llama 3.1: 4
    rope_original_max_seq_len: int = num(8192, 1, MAX_SEQ_LEN, ARCH)
    """llama3 scaling: the context length the model was first trained for."""
    attention: str = choice("auto", ("auto", "sdpa", "flex", "eager"), refused(
        BOTH, "the attention backends agree within float tolerance, not bit for bit"))
    """"auto" (flex on CUDA, sdpa elsewhere; eager for an attention soft-cap on CPU), "sdpa",
    "flex" or "eager" (the scores as a matrix: computes every mechanism, the slowest)."""

    # -- mechanisms of imported families (Gemma 3/2, OLMo 2, Mistral); each has one code site in
    # lmforge/model, a test against a reference (tests/test_families_model.py) and one parity test
    # against transformers (tests/test_families_hf.py). The defaults
    # are the Llama layout lmforge trains from scratch.
    head_dim: int = num(0, 0, 1 << 12, ARCH)
    """Size of each attention head; 0 = dim / n_heads (Gemma 3 270M: 256 with dim 640, 4 heads)."""
    norm_offset: float = num(0.0, 0.0, 1.0, ARCH)
    """RMSNorm's output is x_hat * (norm_offset + weight), computed in float32 when the offset is
    not 0 (Gemma's `(1 + w)` form: weights stored around 0)."""
    norm_placement: str = choice("pre", ("pre", "sandwich", "post"), ARCH)
    """Where each block's norms sit: "pre" (Llama: before attention and before the MLP),
    "sandwich" (Gemma 2/3: also after each, before the residual add), "post" (OLMo 2: only after
    each, before the residual add)."""
    qk_norm_scope: str = choice("head", ("head", "projection"), ARCH)
    """With qk_norm: RMSNorm over each head's q and k (Qwen3, Gemma 3) or over the whole q and k
    projections before they are split into heads (OLMo 2)."""
    mlp_activation: str = choice("silu", ("silu", "gelu_tanh"), ARCH)
    """The gated MLP's activation: SwiGLU's silu, or GELU with the tanh approximation (GeGLU; Gemma)."""
    embed_scale: float = num(1.0, 0.0, 1e4, ARCH, low_open=True)
    """The token embeddings are multiplied by this (Gemma: sqrt(dim))."""
    attn_scale: float = num(0.0, 0.0, 1e4, ARCH)
    """The attention scores' scale; 0 = 1 / sqrt(head_dim) (Gemma: query_pre_attn_scalar ** -0.5)."""
    attn_softcap: float = num(0.0, 0.0, 1e6, ARCH)
    """Attention scores soft-capped to c * tanh(s / c) after scaling, before the mask; 0 = none
    (Gemma 2: 50). sdpa cannot: "auto" picks eager on CPU, flex on CUDA."""
    final_softcap: float = num(0.0, 0.0, 1e6, ARCH)
    """Logits soft-capped to c * tanh(z / c), in the loss too; 0 = none (Gemma 2: 30)."""
    layer_types: list[str] = items((), ARCH, check=lambda name, v: _check_layer_types(name, v))
    """Each layer's attention, "full" or "sliding" (the last sliding_window keys); [] = every layer full."""
    sliding_window: int = num(0, 0, MAX_SEQ_LEN, ARCH)
    """Keys a "sliding" layer sees, the query's own included (query i sees keys j with
    0 <= i - j < sliding_window; transformers' and llama.cpp's rule)."""
    rope_theta_sliding: float = num(0.0, 0.0, 1e12, ARCH)
    """RoPE base of the "sliding" layers, unscaled (Gemma 3: 1e4 local, 1e6 global; rope_scaling
    then applies to the full layers only, as in transformers' Gemma 3); 0 = the sliding layers
    rotate as the full ones do, rope_theta and rope_scaling included (Mistral, Gemma 2)."""
    nope_layers: list[int] = items((), ARCH, check=lambda name, v: _check_layer_indices(name, v))
    """Layers that skip the rotary embedding (NoPE, Kazemnejad et al. 2023; SmolLM3's every 4th)."""
    residual_scale: float = num(1.0, 0.0, 1e4, ARCH, low_open=True)
    """Each block's attention and MLP outputs are multiplied by this before the residual add
    (Granite's residual_multiplier); 1 = none."""
    logit_scale: float = num(1.0, 0.0, 1e6, ARCH, low_open=True)
    """The logits are divided by this, in the loss and in decoding too (Granite's logits_scaling,
    llama.cpp's logit_scale); 1 = none."""
    family: str = text("", allowed("read by export only: the model computes the same whatever it names"))
    """The family export writes the model as (a `model_type` of `lmforge.export.families`: "phi3", ...);
    "" = the first that carries its mechanisms. Not a mechanism (the model never reads it): import sets
    it, so a model two families carry (Phi-3, a windowless Mistral: Llama's computation) exports as what
    it came from; a family that cannot carry the model is refused by export, naming why."""

    def resolved_head_dim(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window."""
        return bool(self.layer_types) and self.layer_types[layer] == "sliding"

    def own_sliding_rope(self) -> bool:
        """Whether the sliding layers rotate with RoPE tables of their own (rope_theta_sliding set
        and a sliding layer that is not in nope_layers); otherwise they share the full layers'."""
        return bool(self.rope_theta_sliding) and any(
            kind == "sliding" and i not in self.nope_layers for i, kind in enumerate(self.layer_types))

    def resolved_ffn_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        return int(math.ceil(int(8 * self.dim / 3) / 64) * 64)


#: The task names `train.eval_tasks` takes (lmforge.evals.builtin.BUILTIN_TASKS and "builtin"; held equal
#: by tests/test_eval_tasks.py); files of your own end in .jsonl or .parquet.
EVAL_TASK_NAMES = ("mutants", "docstrings", "next_line", "identifier", "builtin")


def _check_eval_tasks(name: str, tasks: list[str]) -> None:
    for t in tasks:
        if t not in EVAL_TASK_NAMES and not str(t).endswith((".jsonl", ".parquet")):
            raise ConfigError(f"{name} names {t!r}: expected some of {list(EVAL_TASK_NAMES)} or .jsonl / .parquet "
                              f"task files (the functions task runs with `lmforge eval --tasks functions`).")
    if len(set(tasks)) != len(tasks):
        raise ConfigError(f"{name} = {tasks}: a task appears twice; list each once.")


@dataclass
class TrainConfig:
    init: str = text("", refused(
        PRE, "the weights the run started from; compared as a resolved path by stages/pretrain.py (check_same_init) "
        "before the model is loaded", "SFT and DPO start from sft.init / dpo.init", elsewhere=True))
    """Continued pretraining: a checkpoint to start from (its [model] and weights; its
    tokenizer must be tokenizer.dir's). Empty: from random weights (train.zero_init)."""
    steps: int = num(600, 1, MAX_STEPS, refused(PRE, SCHEDULE, _OWN.format(key="steps"), schedule=True))
    micro_batch_size: int = num(16, 0, 1 << 20, refused(  # 0: "auto"
        PRE, "the rows of every micro-batch and the order of the loss sum", _OWN.format(key="micro_batch_size")))
    """Rows per micro-batch; "auto" (stored as 0, AUTO_MICRO_BATCH): the largest that fits this
    machine's available memory, with train.global_batch_size kept by the accumulation
    (lmforge.train.plan.auto_micro_batch; the resolved numbers go into the run's config.toml)."""
    grad_accum_steps: int = num(1, 1, 1 << 16, refused(PRE, ACCUM, _OWN.format(key="grad_accum_steps"),
                                                       per_rank=True))
    lr: float = num(3e-3, 0.0, 10.0, refused(PRE, SCHEDULE, _OWN.format(key="lr"), schedule=True), low_open=True)
    min_lr_ratio: float = num(0.0, 0.0, 1.0, refused(BOTH, SCHEDULE, schedule=True))
    """The schedule decays to lr * min_lr_ratio."""
    warmup_steps: int = num(50, 0, MAX_STEPS, refused(PRE, SCHEDULE, _OWN.format(key="warmup_steps"), schedule=True))
    schedule: str = choice("wsd", SCHEDULES, refused(BOTH, SCHEDULE, schedule=True))
    """"cosine" (warmup + cosine), "wsd" (warmup-stable-decay) or "constant" (warmup, then lr)."""
    decay_fraction: float = num(0.5, 0.0, 1.0, refused(BOTH, SCHEDULE, schedule=True), low_open=True)
    """wsd only: the fraction of steps spent in the final linear decay."""
    weight_decay: float = num(0.1, 0.0, 1.0, _OPT)
    """Decoupled: each step multiplies the weights by 1 - lr x weight_decay."""
    beta1: float = num(0.9, 0.0, 1.0, _OPT, high_open=True)
    beta2: float = num(0.95, 0.0, 1.0, _OPT, high_open=True)
    grad_clip: float = num(1.0, 0.0, 1e6, refused(BOTH, _OPT.why + " (the norms of the steps taken are not known)"))
    """The largest gradient norm (0 = off)."""
    zero_init: bool = flag(True, refused(PRE, "the initial weights of the run",
                                         "SFT and DPO start from sft.init's / dpo.init's weights"))
    """Pretraining starts the residual projections (attention wo, MLP w2) and an untied output
    head at zero (modded-nanogpt). An initialisation only: the model is the same architecture;
    `Transformer(config)` itself stays randomly initialised."""
    optimizer: str = choice("muon", OPTIMIZERS, refused(BOTH, "another optimizer has another state"))
    """"adamw", or "muon": Muon for the 2-D matrices of the blocks and AdamW for the
    embedding, the head and the norms (lmforge.train.optim.MuonAdamW)."""
    muon_lr_scale: float = num(1.0, 0.0, 100.0, _MUON, low_open=True)
    """muon only: the blocks' matrices step with lr * muon_lr_scale (the update is scaled to
    AdamW's RMS, so 1.0 reuses the AdamW learning rate; 0 would freeze them)."""
    muon_momentum: float = num(0.95, 0.0, 1.0, _MUON, high_open=True)
    """muon only: 1 would never forget a gradient."""
    muon_ns_steps: int = num(5, 1, 100, _MUON)
    """muon only: Newton-Schulz iterations per update."""
    embed_lr_scale: float = num(1.0, 0.0, 100.0, _MUON, low_open=True)
    """muon only: the embedding's AdamW lr is lr * embed_lr_scale."""
    head_lr_scale: float = num(1.0, 0.0, 100.0, _MUON, low_open=True)
    """muon only: the output head's AdamW lr is lr * head_lr_scale."""
    seed: int = num(1337, 0, 2**63, refused(BOTH, "the initial weights and the order of the rows"), high_open=True)
    precision: str = choice("auto", ("auto", "bf16", "fp32"), refused(
        BOTH, "the compute dtype of every step (and Muon's Newton-Schulz dtype)"))
    """"auto" (bf16 autocast where the device has bf16 units, else fp32), "bf16" or "fp32"."""
    data_parallel: str = choice("ddp", ("ddp", "fsdp"), allowed(
        "how ranks share the same arithmetic: the checkpoint holds the full state by parameter name, whatever the "
        "layout (a change of the number of ranks is continued too, with a note)"))
    """"ddp" or "fsdp" (used when launched through torchrun with several ranks)."""
    context_parallel: int = num(1, 1, 1 << 12, refused(BOTH, "how each sequence is split over ranks"))
    """Context-parallel degree: ranks that split one sequence. The world size (ranks torchrun
    starts) = data-parallel degree x context_parallel. Only 1 is implemented yet."""
    global_batch_size: int = num(0, 0, 1 << 30, allowed(
        "a check of micro_batch_size x grad_accum_steps x ranks, which are compared themselves"))
    """Rows per optimizer step over all ranks (0 = derived: micro_batch_size x grad_accum_steps x
    data-parallel degree). Set it to pin the global batch: a launch on another number of ranks
    is then an error that says which grad_accum_steps keeps it."""
    compile: bool = flag(False, refused(
        BOTH, "compiled kernels fuse and reorder float operations: the steps differ in the last bits"))
    activation_checkpointing: bool = flag(False, allowed(
        "the blocks' forward runs again during backward on the same inputs: the same gradients bit for bit"))
    """Keep only each block's input for backward and recompute the block then (torch.utils.checkpoint):
    the activations of one block instead of all of them, for one more forward of the blocks a step
    (LoRA: about a third more compute; full: about a quarter). What TRL's SFTTrainer does by default
    (`gradient_checkpointing=True`); bench/RESULTS.md ("Fine-tuning a user's model") has both ways."""
    checkpoint_every: int = num(0, 0, MAX_STEPS, allowed("when checkpoints are written, not what is computed"))
    """Write a checkpoint every N steps (0 = only at the end)."""
    keep_last: int = num(2, 0, 10**6, allowed("how many checkpoints are kept, not what is computed"))
    """Keep the newest K checkpoints (0 = keep all)."""
    eval_every: int = num(0, 0, MAX_STEPS, allowed(
        "validation runs without gradients on its own batches; it touches neither the training RNG nor the data "
        "position, only the val_loss rows"))
    """Validation loss every N steps (0 = only at the end)."""
    eval_tokens: int = num(65536, 0, 1 << 50, allowed(
        "how much validation data is scored (val_loss rows only), as train.eval_every"))
    """Tokens of the validation split used by periodic validation (0 = all)."""
    eval_tasks: list[str] = items((), allowed(
        "the evaluation suite run at validation is only measured and logged (eval/* rows)"), check=_check_eval_tasks)
    """Evaluation tasks scored at every validation (lmforge.evals: "builtin", mutants, docstrings,
    next_line, identifier, or .jsonl / .parquet task files), logged as eval/NAME/accuracy,
    eval/NAME/centred and eval/suite; [] = none."""
    eval_tasks_limit: int = num(100, 1, 1 << 30, allowed("how many items a periodic evaluation task scores"))
    """Items per task of the periodic evaluation (train.eval_tasks)."""
    log_every: int = num(10, 1, MAX_STEPS, allowed("how often the progress bar prints"))
    time_limit_s: float = num(0.0, 0.0, 1e8, allowed(  # about three years
        "when to stop with a checkpoint; elapsed_s counts the whole run"))
    """Stop (with a checkpoint) after this many seconds of training (0 = no limit)."""
    time_budget_s: float = num(0.0, 0.0, 1e8, refused(
        PRE, "decided train.steps once, when the run started (the step count is in the run's config.toml and "
        "--resume keeps it); another budget would be another schedule",
        "SFT and DPO train sft.steps / dpo.steps (their [train] copy has no budget)"))
    """Pretraining only: seconds of the whole stage to plan the run for (0 = off: train.steps),
    start-up, compile, steps, validations and checkpoints included. At the start of a new run a
    few steps, a validation and a checkpoint are timed on a throw-away copy (as `--dry-run` does)
    and train.steps becomes what fits the time left; the run revises it once from its own steps
    before any step whose learning rate depends on it (lmforge.train.budget). The step count is
    written to the run's config.toml, and `--resume` keeps it (no new measurement), so a resumed
    run stays exact."""
    tensorboard: bool = flag(False, allowed("a copy of the metrics as TensorBoard events, not what is computed"))
    """Also write the metrics, the health warnings and the config as TensorBoard events into
    the run folder's `tensorboard/` (needs the tensorboard package: lmforge[tensorboard])."""
