"""The bases people fine-tune, as tiny local Hugging Face folders: one table of their published configs'
shapes and flags, each built by transformers from its config offline, with a byte-level BPE tokenizer
trained on the spot and the base's own chat template.

    name        architecture     what it brings
    llama-3.2   LlamaForCausalLM tied embeddings, llama3 rope scaling, grouped-query attention
    qwen2.5     Qwen2ForCausalLM tied embeddings, q/k/v biases, ChatML with a default system prompt
    mistral     MistralForCausalLM  a sliding attention window shorter than the examples, [INST] turns
    gemma-2     Gemma2ForCausalLM   tied, attention and final logit soft-capping, sliding and global layers,
                                    embeddings scaled by sqrt(width), a `model` role
    phi-3       Phi3ForCausalLM  fused qkv_proj and gate_up_proj, untied, a template ending in eos_token
    gpt2        GPT2LMHeadModel  Conv1D layers (fan_in_fan_out), tied, learned positions, no pad token,
                                 no chat template of its own (a plain one is given)

The widths are tiny (a few hundred thousand parameters); every flag that changes what the forward computes
is the published one, except GPT-2's dropout (0 here, so a reference outside the template can replay the
steps) and the sliding windows (32 tokens, so that the examples reach past them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WIDTH = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


@dataclass(frozen=True)
class Base:
    name: str
    model_type: str
    config: dict[str, Any]
    template: str
    bos: str | None
    eos: str
    pad: str | None
    specials: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MISTRAL = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}{{ bos_token }}"
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
GEMMA = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}{{ bos_token }}"
    "{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (system if loop.first else '') + message['content'] | trim "
    "+ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] "
    "+ '<|end|>\n' }}{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}"
    "{% endif %}"
)
PLAIN = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)

BASES = {
    b.name: b
    for b in (
        Base(
            "llama-3.2",
            "llama",
            {
                **WIDTH,
                "num_key_value_heads": 2,
                "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5,
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 32.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
                "tie_word_embeddings": True,
            },
            LLAMA3,
            "<|begin_of_text|>",
            "<|eot_id|>",
            "<|finetune_right_pad_id|>",
            ("<|start_header_id|>", "<|end_header_id|>"),
        ),
        Base(
            "qwen2.5",
            "qwen2",
            {
                **WIDTH,
                "num_key_value_heads": 2,
                "max_position_embeddings": 32768,
                "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                "use_sliding_window": False,
                "tie_word_embeddings": True,
            },
            CHATML,
            None,
            "<|im_end|>",
            "<|endoftext|>",
            ("<|im_start|>",),
        ),
        Base(
            "mistral",
            "mistral",
            {
                **WIDTH,
                "num_key_value_heads": 2,
                "max_position_embeddings": 32768,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_window": 32,
                "tie_word_embeddings": False,
            },
            MISTRAL,
            "<s>",
            "</s>",
            None,
            ("[INST]", "[/INST]"),
        ),
        Base(
            "gemma-2",
            "gemma2",
            {
                **WIDTH,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "query_pre_attn_scalar": 16,
                "max_position_embeddings": 8192,
                "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0,
                "sliding_window": 32,
                "layer_types": ["sliding_attention", "full_attention"],
                "hidden_activation": "gelu_pytorch_tanh",
                "tie_word_embeddings": True,
            },
            GEMMA,
            "<bos>",
            "<end_of_turn>",
            "<pad>",
            ("<start_of_turn>", "<eos>"),
        ),
        Base(
            "phi-3",
            "phi3",
            {
                **WIDTH,
                "num_key_value_heads": 4,
                "max_position_embeddings": 4096,
                "sliding_window": 2047,
                "resid_pdrop": 0.0,
                "embd_pdrop": 0.0,
                "tie_word_embeddings": False,
            },
            PHI3,
            "<s>",
            "<|endoftext|>",
            "<|endoftext|>",
            ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        ),
        Base(
            "gpt2",
            "gpt2",
            {
                "n_embd": 64,
                "n_layer": 2,
                "n_head": 4,
                "n_positions": 1024,
                "resid_pdrop": 0.0,
                "embd_pdrop": 0.0,
                "attn_pdrop": 0.0,
                "tie_word_embeddings": True,
            },
            PLAIN,
            "<|endoftext|>",
            "<|endoftext|>",
            None,
        ),
    )
}


def make(base: Base, folder: Path, records: list[dict[str, Any]], seed: int = 0) -> Path:
    """`folder`: config.json, model.safetensors (random weights, the same on every machine), the tokenizer
    (trained on `records`' texts) with the base's chat template, and `folder/sft.jsonl` of `records`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "sft.jsonl", "w") as file:
        file.writelines(json.dumps(r) + "\n" for r in records)
    texts = [m["content"] for r in records for m in r.get("messages", [])]
    texts += [r[k] for r in records for k in ("prompt", "completion") if k in r]
    specials = [t for t in dict.fromkeys((base.bos, base.eos, base.pad, *base.specials)) if t]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    named = {"bos_token": base.bos, "eos_token": base.eos, "pad_token": base.pad}
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **{k: v for k, v in named.items() if v})
    fast.chat_template = base.template
    fast.save_pretrained(folder)
    ids = {f"{k}_id": fast.convert_tokens_to_ids(v) for k, v in named.items() if v}
    config = AutoConfig.for_model(base.model_type, vocab_size=len(fast), **ids, **base.config)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(folder)
    return folder
