"""Tiny Hugging Face folders of the Llama family, built locally as `transformers` saves them.

Each family: the config class of `transformers` with tiny sizes and random weights
(`save_pretrained`), and a BPE trained here with HF `tokenizers` (byte-level; Gemma's
SentencePiece-style), wrapped in
`PreTrainedTokenizerFast` with the family's real special tokens, its BOS convention
(tokenizer.json's post-processor) and its real public chat template:

    smollm   LlamaForCausalLM, tied head; ChatML with SmolLM2's default system prompt,
             eos_token <|im_end|>, bos_token <|im_start|> (never prepended), no BOS
    llama3   LlamaForCausalLM, untied, Llama 3.1 RoPE scaling; Llama 3's header template,
             eos_token <|eot_id|>, <|begin_of_text|> prepended
    mistral  MistralForCausalLM (no sliding); Mistral's [INST] template, <s> prepended, </s>
    qwen2    Qwen2ForCausalLM (q/k/v biases), embedding rows past the tokenizer's vocab;
             Qwen2.5's ChatML with its default system prompt, eos_token <|im_end|>, no BOS
    qwen3    Qwen3ForCausalLM (QK-norm); the same Qwen2.5 ChatML template
    gemma3   Gemma3ForCausalLM (model_type gemma3_text): 7 layers (sliding x5, full, sliding),
             window 6, head_dim 48 != 64/2, query_pre_attn_scalar 40, RoPE bases 1e6 full / 1e4
             sliding, tied head; SentencePiece-style BPE (byte fallback, "▁", no dummy prefix)
             with Gemma's specials <pad> <eos> <bos> <unk> <start_of_turn> <end_of_turn>, <bos>
             prepended, eos_token <eos>, Gemma 3's public chat template
    gemma2   Gemma2ForCausalLM: 4 layers alternating sliding/full, window 6, head_dim 48,
             attention soft-cap 2.0 and logit soft-cap 3.0 (small: tanh far from linear); Gemma's
             tokenizer and template
    olmo2    Olmo2ForCausalLM (norms after attention and MLP, QK-norm over the projections);
             byte-level BPE with <|endoftext|> (bos and eos, not prepended) and <|pad|>, Tülu 3's
             template as OLMo 2 Instruct ships it
    mistral_sliding  MistralForCausalLM with sliding_window 6 (< max_position_embeddings):
             the window slides; Mistral's tokenizer and template
    granite  GraniteForCausalLM: embedding multiplier 6, attention multiplier 0.1 (not
             1/sqrt(16)), residual multiplier 0.22, logits divided by 0.5; tied head; byte-level BPE
             with <|end_of_text|> (bos and eos, not prepended), Granite 3's roles without tools
    smollm3  SmolLM3ForCausalLM: 4 layers, the last without RoPE (transformers' default every 4th),
             tied head; byte-level BPE with Llama 3's <|begin_of_text|> (not prepended), eos_token
             <|im_end|>, SmolLM3's ChatML without its metadata block
    phi3     Phi3ForCausalLM (fused qkv_proj and gate_up_proj), 4 heads / 2 key-value heads, no
             window, untied; byte-level BPE with Phi-3's specials (<s> not prepended, eos_token
             <|endoftext|>, turns closed by <|end|>; each strips the whitespace after it, as
             Phi-3's tokenizer.json says, but <unk>, <s> and <|endoftext|>) and
             Phi-3-mini-4k-instruct's template
    phi3_sliding  the same with sliding_window 6 (< max_position_embeddings): every layer slides

Every model is built with attn_implementation="eager" and every norm weight is random (Gemma's
zero-initialised (1 + w) norms would hide offset and placement bugs).

Nothing is downloaded: the templates are the public texts, written out below.
"""

from __future__ import annotations

from pathlib import Path

import torch

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)

#: Qwen3's way with history (abridged from its public template): the last assistant turn after
#: the last user query gets a (here empty) <think> block, earlier ones do not, so a reply renders
#: differently once another turn follows it. lmforge refuses such a template.
QWEN3_THINKING_TEMPLATE = (
    "{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{%- if loop.last %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: Gemma 3's public chat template (google/gemma-3-*-it tokenizer_config.json), as written there
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n"
)

#: OLMo 2 Instruct's template (Tülu 3's): <|user|> / <|assistant|> blocks, the reply closed by EOS
OLMO2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<|system|>\n' + message['content'] + '\n' }}{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\n' + message['content'] + '\n' }}{% elif message['role'] == 'assistant' %}"
    "{% if not loop.last %}{{ '<|assistant|>\n'  + message['content'] + eos_token + '\n' }}"
    "{% else %}{{ '<|assistant|>\n'  + message['content'] + eos_token }}{% endif %}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}"
)

#: SmolLM3's ChatML without its metadata system block (which calls strftime_now) and /think switches
SMOLLM3_TEMPLATE = (
    "{%- for message in messages -%}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

#: Granite 3's chat format without its tools and documents blocks
GRANITE_TEMPLATE = (
    "{%- for message in messages -%}{{ '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content']"
    " + '<|end_of_text|>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif -%}"
)

GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
_GEMMA_TOKENIZER = (GEMMA_SPECIALS, dict(bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"),
                    "<bos>", GEMMA3_TEMPLATE)

PHI3_SPECIALS = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"]
#: Phi-3-mini-4k-instruct's tokenizer_config.json chat_template
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

#: family -> (special tokens in id order, tokenizer kwargs, BOS prepended by the post-processor, template)
TOKENIZERS = {
    "smollm": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
               dict(bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>",
                    unk_token="<|endoftext|>"), None, SMOLLM2_TEMPLATE),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"), "<|begin_of_text|>", LLAMA3_TEMPLATE),
    "mistral": (["<unk>", "<s>", "</s>"], dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"), "<s>",
                MISTRAL_TEMPLATE),
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"), None, QWEN25_TEMPLATE),
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"), None, QWEN25_TEMPLATE),
    "gemma3": _GEMMA_TOKENIZER,
    "gemma2": _GEMMA_TOKENIZER,
    "olmo2": (["<|endoftext|>", "<|pad|>"],
              dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|pad|>"), None, OLMO2_TEMPLATE),
    "mistral_sliding": (["<unk>", "<s>", "</s>"], dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"), "<s>",
                        MISTRAL_TEMPLATE),
    "granite": (["<|end_of_text|>", "<fim_prefix>", "<|start_of_role|>", "<|end_of_role|>", "<|pad|>"],
                dict(bos_token="<|end_of_text|>", eos_token="<|end_of_text|>", pad_token="<|pad|>"), None,
                GRANITE_TEMPLATE),
    "phi3": (PHI3_SPECIALS, dict(bos_token="<s>", eos_token="<|endoftext|>", unk_token="<unk>",
                                 pad_token="<|endoftext|>"), None, PHI3_TEMPLATE),
    "phi3_sliding": (PHI3_SPECIALS, dict(bos_token="<s>", eos_token="<|endoftext|>", unk_token="<unk>",
                                         pad_token="<|endoftext|>"), None, PHI3_TEMPLATE),
    "smollm3": (["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|finetune_right_pad_id|>"],
                dict(bos_token="<|begin_of_text|>", eos_token="<|im_end|>", pad_token="<|finetune_right_pad_id|>"), None,
                SMOLLM3_TEMPLATE),
}

W_PHI3 = 6  # phi3_sliding's window

#: families whose special tokens have rstrip = true (Phi-3's tokenizer.json: all but <unk>, <s>, <|endoftext|>)
RSTRIP_FAMILIES = ("phi3", "phi3_sliding")

#: families whose tokenizer is SentencePiece-style BPE (Gemma's), not byte-level
SPM_FAMILIES = ("gemma3", "gemma2")

TEXT = ("def add(a, b):\n    return a + b\n\nHello, world! The quick brown fox jumps over the lazy dog.\n"
        "You are a helpful assistant. Hi there, how can I help you today? 12345 café\n")


def build_tokenizer(family: str, folder: Path, template: str | None = "family"):
    """A PreTrainedTokenizerFast for `family`, saved into `folder`; returns it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials, kwargs, bos, own_template = TOKENIZERS[family]
    chat = own_template if template == "family" else template
    if family in SPM_FAMILIES:
        return _gemma_tokenizer(folder, specials, kwargs, bos, chat)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if family in RSTRIP_FAMILIES:  # Phi-3's specials strip the whitespace after them (not <unk>, <s>, <|endoftext|>)
        specials = [AddedToken(t, special=True, normalized=False, rstrip=t not in ("<unk>", "<s>", "<|endoftext|>"))
                    for t in specials]
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 20, trainer=trainer)
    if bos is not None:  # the tokenizer prepends its BOS, as Llama 3's and Mistral's do
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=chat, **kwargs)
    fast.save_pretrained(str(folder))
    return fast


def _gemma_tokenizer(folder: Path, specials: list[str], kwargs: dict, bos: str, chat: str | None):
    """Gemma's tokenizer.json layout: SentencePiece BPE with byte fallback (<0xNN> tokens), " " as
    "▁" and no dummy prefix (Gemma's normalizer only replaces spaces; the decoder strips nothing),
    <unk> at id 3, `bos` prepended by the post-processor; saved into `folder`."""
    import json

    from gguf_helpers import _spm_tokenizer
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(_spm_tokenizer([TEXT] * 20, 330, specials).to_str())
    spec["model"]["unk_token"] = kwargs["unk_token"]
    spec["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    spec["decoder"]["decoders"] = [d for d in spec["decoder"]["decoders"] if d["type"] != "Strip"]
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=chat, add_bos_token=True,
                                   add_eos_token=False, clean_up_tokenization_spaces=False, **kwargs)
    fast.save_pretrained(str(folder))
    return fast


def build_model(family: str, vocab_size: int, seed: int = 0, **overrides):
    """A tiny random model of `family` (dim 64; 2 layers, 4/2 heads unless the family's sketch in
    the module docstring says otherwise), every weight random, attn_implementation "eager"."""
    import transformers

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=vocab_size, rms_norm_eps=1e-6,
                  max_position_embeddings=256, rope_theta=5000.0)
    if family in ("smollm", "llama3"):
        cls, cfg = transformers.LlamaForCausalLM, transformers.LlamaConfig(**common, tie_word_embeddings=family == "smollm")
        if family == "llama3":
            cfg.rope_parameters = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    elif family == "mistral":
        cls, cfg = transformers.MistralForCausalLM, transformers.MistralConfig(**common, sliding_window=None)
    elif family == "mistral_sliding":
        cls, cfg = transformers.MistralForCausalLM, transformers.MistralConfig(**common, sliding_window=6)
    elif family == "qwen2":
        common.pop("head_dim")
        cls, cfg = transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**common)
    elif family == "qwen3":
        cls, cfg = transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**common)
    elif family == "gemma3":
        cls = transformers.Gemma3ForCausalLM
        cfg = transformers.Gemma3TextConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=2,
            num_key_value_heads=1, head_dim=48, query_pre_attn_scalar=40, sliding_window=6, rms_norm_eps=1e-6,
            max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    elif family == "gemma2":
        cls = transformers.Gemma2ForCausalLM
        cfg = transformers.Gemma2Config(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=48, query_pre_attn_scalar=40, sliding_window=6, rms_norm_eps=1e-6,
            max_position_embeddings=256, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
            tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    elif family == "smollm3":  # 4 layers: layer 3 skips RoPE (no_rope_layer_interval 4)
        common.pop("head_dim")
        cls, cfg = transformers.SmolLM3ForCausalLM, transformers.SmolLM3Config(
            **{**common, "num_hidden_layers": 4}, tie_word_embeddings=True, pad_token_id=4, bos_token_id=0,
            eos_token_id=3)
    elif family == "granite":  # Granite 3.0 2B's four scalars (a smaller embedding multiplier: tiny weights)
        common.pop("head_dim")
        cls, cfg = transformers.GraniteForCausalLM, transformers.GraniteConfig(
            **common, tie_word_embeddings=True, embedding_multiplier=6.0, attention_multiplier=0.1,
            residual_multiplier=0.22, logits_scaling=0.5, bos_token_id=0, eos_token_id=0, pad_token_id=4)
    elif family in ("phi3", "phi3_sliding"):  # Phi-3 derives head_dim = hidden_size / heads
        common.pop("head_dim")
        cls, cfg = transformers.Phi3ForCausalLM, transformers.Phi3Config(
            **common, sliding_window=W_PHI3 if family == "phi3_sliding" else None, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=3, pad_token_id=3)
    elif family == "olmo2":
        common.pop("head_dim")
        cls, cfg = transformers.Olmo2ForCausalLM, transformers.Olmo2Config(
            **common, tie_word_embeddings=False, eos_token_id=0, pad_token_id=1, bos_token_id=None)
    else:
        raise ValueError(f"no tiny model for family {family!r}; one of {sorted(TOKENIZERS)}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    gemma = family in ("gemma3", "gemma2")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's (1 + w): w itself random around 0
                p.copy_(0.5 * torch.randn_like(p) if gemma else 1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model


def build_folder(family: str, folder: Path, template: str | None = "family", **overrides):
    """Tokenizer + model of `family` saved into `folder` by transformers; returns (model, tokenizer)."""
    fast = build_tokenizer(family, folder, template)
    vocab = len(fast)
    model = build_model(family, vocab + (7 if family == "qwen2" else 0), **overrides)
    model.save_pretrained(str(folder))
    return model, fast
