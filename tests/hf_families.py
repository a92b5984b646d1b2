"""Tiny Hugging Face folders of the Llama family, built locally as `transformers` saves them.

Each family: the config class of `transformers` with tiny sizes and random weights
(`save_pretrained`), and a byte-level BPE trained here with HF `tokenizers`, wrapped in
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
}

TEXT = ("def add(a, b):\n    return a + b\n\nHello, world! The quick brown fox jumps over the lazy dog.\n"
        "You are a helpful assistant. Hi there, how can I help you today? 12345 café\n")


def build_tokenizer(family: str, folder: Path, template: str | None = "family"):
    """A PreTrainedTokenizerFast for `family`, saved into `folder`; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials, kwargs, bos, own_template = TOKENIZERS[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 20, trainer=trainer)
    if bos is not None:  # the tokenizer prepends its BOS, as Llama 3's and Mistral's do
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    chat = own_template if template == "family" else template
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=chat, **kwargs)
    fast.save_pretrained(str(folder))
    return fast


def build_model(family: str, vocab_size: int, seed: int = 0, **overrides):
    """A tiny random model of `family` (dim 64, 2 layers, 4/2 heads), every weight random."""
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
    elif family == "qwen2":
        common.pop("head_dim")
        cls, cfg = transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**common)
    else:
        cls, cfg = transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**common)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
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
