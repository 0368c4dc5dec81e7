"""A tiny pretrained-model folder and an instruction set, made offline: `experiment=lora_sft` on a laptop.

    <folder>/base/      a Hugging Face model folder: config.json (a Llama-shaped architecture, tiny),
                        model.safetensors (random weights), tokenizer.json (a byte-level BPE tokenizer
                        trained here on the instructions) with a chat template
    <folder>/sft.jsonl  instructions as chat messages and prompt/completion pairs (reverse a word, spell
                        it in capitals, count on): small tasks whose answers follow from the prompt

Nothing is downloaded, and from here on the path is exactly a real model's: the base is read from its
folder by `model.base.path`, its tokenizer and chat template by `data.tokenizer`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
# The roles' markers, each message's text, and the assistant's turn closed by <|eos|> (generation stops there)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ '<|eos|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
ARCHITECTURE = {
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,  # as most small bases people fine-tune (Qwen2.5, Llama-3.2, Gemma)
}
SYLLABLES = ["ka", "lo", "mi", "ren", "to", "vi", "sul", "ne", "pa", "dor", "fi", "gu", "ha", "je", "ost", "ru"]


def instructions(count: int = 600, seed: int = 0) -> list[dict]:
    """`count` records: most as chat messages (some with a system message, some of two turns), every
    fifth as a prompt/completion pair."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        word = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))
        number = rng.randint(0, 98)
        prompt, answer = rng.choice(
            [
                (f"Reverse the word {word}.", word[::-1]),
                (f"Spell {word} in capitals.", word.upper()),
                (f"What number comes after {number}?", str(number + 1)),
                (f"Say {word} twice.", f"{word} {word}"),
            ]
        )
        if i % 5 == 4:
            records.append({"prompt": prompt, "completion": answer})
            continue
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        if i % 7 == 0:
            messages.insert(0, {"role": "system", "content": "Answer in as few words as you can."})
        if i % 11 == 0:
            messages += [
                {"role": "user", "content": f"And {word} reversed?"},
                {"role": "assistant", "content": word[::-1]},
            ]
        records.append({"messages": messages})
    return records


def make(folder: Path, seed: int = 0, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """Write `<folder>/base/` and `<folder>/sft.jsonl` (see the module docstring); `chat_template=None`
    makes a base without one, as a pretrained base that was never tuned for chat comes."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    records = instructions(seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "sft.jsonl", "w") as file:
        file.writelines(json.dumps(r) + "\n" for r in records)

    texts = [
        m["content"] for r in records for m in r.get("messages", [])
    ] + [r[k] for r in records for k in ("prompt", "completion") if k in r]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=512,
            special_tokens=SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    fast.chat_template = chat_template
    base = folder / "base"
    fast.save_pretrained(base)

    config = LlamaConfig(
        vocab_size=len(fast),
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        **ARCHITECTURE,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)  # the same random "pretrained" weights on every machine
    try:
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(base)
