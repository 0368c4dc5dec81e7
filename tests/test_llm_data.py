"""The data people fine-tune on (docs/guides/fine-tune-a-language-model.md, "Your data"): every line format
read as the conversation it means, the loss on the tokens the rule names under the chat templates of the
bases people use, every bad line one sentence with its file and line, cut examples counted and an empty
split refused, a digest that follows what changes the tokens, and the sample callback on a base without a
chat template.

The tokenizers are trained here, on the spot, with the `tokenizers` library, each with the special tokens
and the chat template its base ships (`BASES`): Llama-3, Qwen2.5 (ChatML, and the same with `{% generation
%}` marks as TRL's training templates add them), Mistral's `[INST]` (v0.2, and v0.3's, which moves the
system message into the last user turn), Gemma, Phi-3, and GPT-2 without a chat template. In-process and
quick but for the sample (a model) and the real runs: an alpaca file with data.chat_template=chatml on a
base without a template, and bad data ending a run with exit status 2 before training.
"""

from __future__ import annotations

import json
import logging
import re
import string
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpctrain.runtime.errors import UserError
from tests.helpers import ROOT, assert_ok, read_metrics, require_modules, run_dirs, train

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN25 = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# Qwen2.5's, the assistant's turn marked as TRL's training template marks it: from the newline after the role
QWEN25_MARKED = QWEN25.replace(
    """(message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}""",
    """(message.role == "user") or (message.role == "system" and not loop.first) %}""",
).replace(
    """    {%- endif %}
{%- endfor %}""",
    """    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant' }}
        {%- generation %}
        {{- '\\n' + message.content + '<|im_end|>\\n' }}
        {%- endgeneration %}
    {%- endif %}
{%- endfor %}""",
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
MISTRAL_V3 = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)


@dataclass(frozen=True)
class Base:
    """A base's tokenizer as it ships: its special tokens, its pre-tokenizer, its chat template (or none)."""

    special: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str | None
    template: str | None
    metaspace: bool = False  # SentencePiece-style (Llama-2, Mistral) rather than byte-level (GPT-2, Llama-3)


BASES = {
    "llama3": Base(
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "<|begin_of_text|>",
        "<|eot_id|>",
        None,
        LLAMA3,
    ),
    "qwen2.5": Base(
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>", "<|endoftext|>", QWEN25
    ),
    "qwen2.5-marked": Base(
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>", "<|endoftext|>", QWEN25_MARKED
    ),
    "mistral": Base(("<unk>", "<s>", "</s>"), "<s>", "</s>", None, MISTRAL, metaspace=True),
    "mistral-v0.3": Base(("<unk>", "<s>", "</s>"), "<s>", "</s>", None, MISTRAL_V3, metaspace=True),
    "gemma": Base(
        ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<eos>", "<pad>", GEMMA
    ),
    "phi3": Base(
        ("<unk>", "<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        "<s>",
        "<|endoftext|>",
        "<|endoftext|>",
        PHI3,
    ),
    "gpt2": Base(("<|endoftext|>",), "<|endoftext|>", "<|endoftext|>", None, None),
}
WORDS = "Reverse the word kalo olak lo ol Be brief And reversed Say mi twice Spell capitals What number comes after"


def require_llm() -> None:
    require_modules("transformers", "tokenizers", install="pip install -e '.[llm]'")


def make_tokenizer(base: Base, folder: Path) -> Path:
    """`folder` holding the base's tokenizer.json and tokenizer_config.json, trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(
        models.BPE(unk_token="<unk>" if base.metaspace else None, byte_fallback=base.metaspace)
    )
    if base.metaspace:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
        alphabet: list[str] = []
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    corpus = [WORDS, WORDS.lower(), "You are Qwen, created by Alibaba Cloud.", string.printable]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(base.special), initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(corpus * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=base.bos, eos_token=base.eos, pad_token=base.pad
    )
    fast.chat_template = base.template
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    require_llm()
    root = tmp_path_factory.mktemp("bases")
    return {name: make_tokenizer(base, root / name) for name, base in BASES.items()}


def _folder(tokenizers: dict[str, Path], base: str) -> Path:
    return tokenizers[base]


@pytest.fixture
def instructions(tokenizers: dict[str, Path], tmp_path: Path):
    """`make(lines, base=..., **settings)`: an InstructionsDataModule over a file of `lines` (objects are
    written as JSON, strings and bytes as they are) and the base's tokenizer."""
    from myproject.data.instructions import InstructionsDataModule

    def make(lines=(), base: str = "qwen2.5", name: str = "data.jsonl", **settings) -> InstructionsDataModule:
        path = tmp_path / name
        path.write_bytes(b"".join(_line(x) + b"\n" for x in lines))
        return InstructionsDataModule(str(path), str(tokenizers[base]), str(tmp_path / "tokens"), **settings)

    return make


def _line(line: object) -> bytes:
    if isinstance(line, bytes):
        return line
    return (line if isinstance(line, str) else json.dumps(line)).encode()


def tokenized(data) -> dict[str, list]:
    """Every split's examples, tokenized as the run tokenizes them (the shards are written from these)."""
    return {split: list(examples) for split, examples in data.tokenize().items()}


def counted_runs(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    """The text of each run of consecutive tokens the loss is on."""
    runs: list[list[int]] = []
    for i, (token, label) in enumerate(zip(ids, labels, strict=True)):
        if label == -100:
            continue
        if runs and labels[i - 1] != -100:
            runs[-1].append(token)
        else:
            runs.append([token])
    return [tokenizer.decode(run) for run in runs]


CONVERSATION = [
    {"role": "user", "content": "Reverse the word kalo."},
    {"role": "assistant", "content": "olak"},
    {"role": "user", "content": "And lo?"},
    {"role": "assistant", "content": "ol"},
]

# ------------------------------------------------------------------------------------------------ formats

ONE_TURN = {
    "messages": [
        {"role": "user", "content": "Reverse the word kalo."},
        {"role": "assistant", "content": "olak"},
    ]
}
# The same exchange in each shape a line may have (and with data.fields for names of one's own)
SAME_EXCHANGE = {
    "sharegpt": (
        {
            "conversations": [
                {"from": "human", "value": "Reverse the word kalo."},
                {"from": "gpt", "value": "olak"},
            ]
        },
        {},
    ),
    "prompt/completion": ({"prompt": "Reverse the word kalo.", "completion": "olak"}, {}),
    "alpaca": ({"instruction": "Reverse the word kalo.", "input": "", "output": "olak"}, {}),
    "alpaca without input": ({"instruction": "Reverse the word kalo.", "output": "olak"}, {}),
    "fields: prompt/completion": (
        {"question": "Reverse the word kalo.", "answer": "olak", "id": 7},
        {"prompt": "question", "completion": "answer"},
    ),
    "fields: alpaca": (
        {"task": "Reverse the word kalo.", "response": "olak"},
        {"instruction": "task", "output": "response"},
    ),
    "fields: messages": (
        {
            "dialog": [
                {"speaker": "user", "text": "Reverse the word kalo."},
                {"speaker": "assistant", "text": "olak"},
            ]
        },
        {"messages": "dialog", "role": "speaker", "content": "text"},
    ),
    "fields: sharegpt under another name": (
        {"chat": [{"from": "human", "value": "Reverse the word kalo."}, {"from": "gpt", "value": "olak"}]},
        {"messages": "chat"},
    ),
}


@pytest.mark.parametrize("shape", list(SAME_EXCHANGE))
def test_every_shape_of_a_line_is_the_conversation_it_means(instructions, shape: str):
    line, fields = SAME_EXCHANGE[shape]
    reference = instructions().tokens(ONE_TURN)
    assert instructions(fields=fields).tokens(line) == reference


def test_alpaca_input_follows_the_instruction_after_a_blank_line(instructions):
    data = instructions()
    alpaca = data.tokens({"instruction": "Reverse the word.", "input": "kalo", "output": "olak"})
    asked = {
        "messages": [
            {"role": "user", "content": "Reverse the word.\n\nkalo"},
            {"role": "assistant", "content": "olak"},
        ]
    }
    assert alpaca == data.tokens(asked)


def test_plain_text_is_its_tokens_and_the_end_of_text_all_counted(instructions):
    data = instructions(base="gpt2")
    ids, labels = data.tokens({"text": "Reverse the word kalo. olak"})
    tokenizer = data.tokenizer
    assert ids == tokenizer("Reverse the word kalo. olak")["input_ids"] + [tokenizer.eos_token_id]
    assert labels == ids
    assert instructions(base="gpt2", fields={"text": "body"}).tokens(
        {"body": "Reverse the word kalo. olak"}
    ) == (ids, labels)


# ------------------------------------------------------------------------------------------- the loss rule

# The project's rule, per base: an assistant turn counts its text and what the template closes the turn with;
# the template's closing of the whole conversation counts with the last turn; marks count what they mark.
END_OF_TURN = {
    "llama3": "<|eot_id|>",
    "qwen2.5": "<|im_end|>\n",
    "qwen2.5-marked": "<|im_end|>\n",
    "mistral": "</s>",
    "mistral-v0.3": "</s>",
    "gemma": "<end_of_turn>\n",
    "phi3": "<|end|>\n",
    "gpt2": "<|im_end|>\n",  # data.chat_template=chatml
}
CLOSING = {"phi3": "<|endoftext|>"}  # after the conversation, not after a turn: Phi-3's end of text
# TRL's Qwen2.5 training template marks from the newline after the role
MARKED_BEFORE = {"qwen2.5-marked": "\n"}


@pytest.mark.parametrize("base", list(END_OF_TURN))
def test_the_loss_is_on_each_assistant_turn_and_its_end_of_turn(instructions, base: str):
    data = instructions(base=base, chat_template="chatml" if base == "gpt2" else None)
    ids, labels = data.tokens({"messages": CONVERSATION})
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    expected = [MARKED_BEFORE.get(base, "") + answer + END_OF_TURN[base] for answer in answers]
    expected[-1] += CLOSING.get(base, "")
    assert counted_runs(data.tokenizer, ids, labels) == expected
    assert all(label in (-100, token) for token, label in zip(ids, labels, strict=True))
    assert (
        ids == data.tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    )
    all_ids, all_labels = instructions(
        base=base, chat_template="chatml" if base == "gpt2" else None, loss_on="all"
    ).tokens({"messages": CONVERSATION})
    assert all_ids == ids and all_labels == ids


WITH_SYSTEM = [{"role": "system", "content": "Be brief."}, *CONVERSATION]


@pytest.mark.parametrize(
    "messages", [CONVERSATION, WITH_SYSTEM, CONVERSATION[:2]], ids=["two turns", "system", "one turn"]
)
def test_generation_marks_count_exactly_the_tokens_of_transformers_assistant_mask(instructions, messages):
    """Qwen2.5's template with TRL's marks: the counted tokens are transformers' (and so TRL's) mask, which
    holds the newline after `<|im_start|>assistant` too: one token a turn more than the project's rule."""
    data = instructions(base="qwen2.5-marked")
    ids, labels = data.tokens({"messages": messages})
    theirs = data.tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ids == theirs["input_ids"]
    assert [label != -100 for label in labels] == [bool(m) for m in theirs["assistant_masks"]]
    unmarked_ids, unmarked = instructions(base="qwen2.5").tokens({"messages": messages})
    assert unmarked_ids == ids
    newline = data.tokenizer.convert_tokens_to_ids("Ċ")
    extra = [i for i, (a, b) in enumerate(zip(labels, unmarked, strict=True)) if a != b]
    turns = sum(m["role"] == "assistant" for m in messages)
    assert len(extra) == turns and all(ids[i] == newline and unmarked[i] == -100 for i in extra)


def test_chatml_marks_what_the_projects_rule_counts(instructions, tmp_path: Path):
    """The named template carries marks where the rule without them puts the turn: both count the same."""
    from myproject.data.chat import CHATML

    unmarked = tmp_path / "chatml.jinja"
    unmarked.write_text(re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", CHATML))
    for messages in (CONVERSATION, WITH_SYSTEM):
        marked = instructions(base="gpt2", chat_template="chatml").tokens({"messages": messages})
        assert instructions(base="gpt2", chat_template=str(unmarked)).tokens({"messages": messages}) == marked


# ------------------------------------------------------------------------------------------------ bad lines

GOOD = {"prompt": "Say mi twice.", "completion": "mi mi"}
USER, ANSWER = {"role": "user", "content": "Reverse the word kalo."}, {"role": "assistant", "content": "olak"}
# (a bad line, the base whose template reads it, what the sentence says)
BAD_LINES = {
    "not JSON": ('{"messages": [', "qwen2.5", r"is not JSON \(.*\); write one JSON object a line"),
    "not UTF-8": (b'{"text": "caf\xe9"}', "qwen2.5", r"is not UTF-8 text \(invalid continuation byte\)"),
    "not an object": ("[1, 2]", "qwen2.5", r"is a JSON list, not an object"),
    "no known shape": (
        {"question": "q", "answer": "a"},
        "qwen2.5",
        r"has none of the known shapes .* but answer, question; .*data\.fields",
    ),
    "a message without content": (
        {"messages": [{"role": "user"}, ANSWER]},
        "qwen2.5",
        r"message 1 has no content; give every message a role and a content",
    ),
    "a message without role": (
        {"messages": [{"content": "hi"}, ANSWER]},
        "qwen2.5",
        r"message 1 has no role",
    ),
    "ShareGPT without from": (
        {"conversations": [{"value": "hi"}, {"from": "gpt", "value": "x"}]},
        "qwen2.5",
        r"message 1 has no from",
    ),
    "content null": (
        {"messages": [{"role": "user", "content": None}, ANSWER]},
        "qwen2.5",
        r"message 1 has no content",
    ),
    "content a number": (
        {"messages": [{"role": "user", "content": 3}, ANSWER]},
        "qwen2.5",
        r"message 1's content is a number \(3\), not a string",
    ),
    "content a list": (
        {"messages": [USER, {"role": "assistant", "content": ["olak"]}]},
        "qwen2.5",
        r"message 2's content is a list, not a string",
    ),
    "an empty answer": (
        {"messages": [USER, {"role": "assistant", "content": " "}]},
        "qwen2.5",
        r"message 2 \(assistant\) is empty",
    ),
    "no messages": (
        {"messages": []},
        "qwen2.5",
        r"messages is an empty list; write it as a list of messages",
    ),
    "messages a string": (
        {"messages": "hi"},
        "qwen2.5",
        r"messages is a string; write it as a list of messages",
    ),
    "a prompt without completion": ({"prompt": "hi"}, "qwen2.5", r"has prompt but no completion; give both"),
    "an empty completion": ({"prompt": "hi", "completion": ""}, "qwen2.5", r"completion is empty"),
    "a prompt of messages": (
        {"prompt": [USER], "completion": [ANSWER]},
        "qwen2.5",
        r"prompt is a list of messages; write the whole conversation as \{\"messages\": \[\.\.\.\]\}",
    ),
    "an instruction without output": (
        {"instruction": "hi", "input": "x"},
        "qwen2.5",
        r"has instruction but no output",
    ),
    "input a number": (
        {"instruction": "hi", "input": 4, "output": "x"},
        "qwen2.5",
        r"input is a number \(4\), not a string",
    ),
    "text a number": ({"text": 5}, "qwen2.5", r"text is a number \(5\), not a string"),
    "empty text": ({"text": ""}, "qwen2.5", r"text is empty"),
    "no assistant message": (
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "x"}]},
        "qwen2.5",
        r"has no assistant message \(its roles: user, bot\)",
    ),
    "the assistant first": (
        {"messages": [ANSWER, USER, ANSWER]},
        "qwen2.5",
        r"opens with the assistant's message",
    ),
    "a role the template refuses": (
        {"messages": [{"role": "system", "content": "Be brief."}, USER, ANSWER]},
        "gemma",
        r"the chat template refuses this conversation \(System role not supported\)",
    ),
    "roles out of turn": (
        {"messages": [USER, USER, ANSWER]},
        "mistral",
        r"refuses this conversation \(Conversation roles must alternate",
    ),
    "a system message Mistral v0.3 moves": (
        {"messages": [{"role": "system", "content": "Be brief."}, USER, ANSWER]},
        "mistral-v0.3",
        r"renders the conversation before message 3 .* otherwise on its own .*\{% generation %\}",
    ),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_bad_line_is_one_sentence_with_its_file_and_line(instructions, case: str):
    line, base, says = BAD_LINES[case]
    data = instructions([GOOD, "", GOOD, line, GOOD], base=base)  # the bad one is line 4 (line 2 is empty)
    with pytest.raises(UserError) as refused:
        tokenized(data)
    message = str(refused.value)
    assert message.startswith(f"{data.path}:4") and re.search(says, message), message
    assert "\n" not in message and message.endswith("."), message


def test_data_fields_names_only_fields(instructions):
    with pytest.raises(
        UserError, match=r"data\.fields names question, which is not a field of an example; .*prompt:question"
    ):
        instructions(fields={"question": "prompt"})


# ------------------------------------------------------------------------------------------- chat templates


def test_a_conversation_on_a_base_without_a_template_is_one_sentence_before_any_tokenizing(instructions):
    data = instructions([GOOD, GOOD, ONE_TURN], base="gpt2")
    with pytest.raises(
        UserError,
        match=r":1 is a conversation, but the tokenizer in data\.tokenizer=.* has no chat template .* data\.chat_template=chatml",
    ):
        data.check_available()
    assert not list((data.cache_dir).glob("instructions-*")), "nothing is written"
    plain = instructions([{"text": "Reverse the word kalo. olak"}] * 3, base="gpt2", name="plain.jsonl")
    assert [len(v) for v in tokenized(plain).values()] == [2, 1]


def test_data_chat_template_names_a_template_or_a_file(instructions, tmp_path: Path):
    from myproject.data.chat import CHATML

    data = instructions(base="gpt2", chat_template="chatml")
    assert data.tokenizer.chat_template == CHATML
    ids, labels = data.tokens(ONE_TURN)
    assert (
        data.tokenizer.decode(ids)
        == "<|im_start|>user\nReverse the word kalo.<|im_end|>\n<|im_start|>assistant\nolak<|im_end|>\n"
    )
    assert counted_runs(data.tokenizer, ids, labels) == ["olak<|im_end|>\n"]
    own = tmp_path / "template.jinja"
    own.write_text(QWEN25_MARKED)
    replaced = instructions(base="qwen2.5", chat_template=str(own))  # replaces the tokenizer's own
    assert replaced.tokens(ONE_TURN) == instructions(base="qwen2.5-marked").tokens(ONE_TURN)
    with pytest.raises(
        UserError, match=r"data\.chat_template=chatlm is neither a named template \(chatml\) nor a file"
    ):
        instructions(chat_template="chatlm")


# ------------------------------------------------------------------------- cut examples and empty splits


def test_examples_cut_by_max_length_are_counted_per_split(instructions, caplog: pytest.LogCaptureFixture):
    long_answer = {"prompt": "Say mi twice.", "completion": "mi " * 40}  # cut, with some of its answer left
    long_prompt = {"prompt": "Reverse the word " + "kalo " * 40 + ".", "completion": "olak"}  # cut to nothing
    lines = [GOOD, long_answer, long_prompt] * 10
    length = len(instructions().tokens(GOOD)[0])  # the short line fits, the others are cut
    data = instructions(lines, max_length=length, val_fraction=0.25)
    alone = [data.tokens(line) for line in lines]
    cut = sum(len(ids) > length for ids, _ in alone)
    emptied = sum(len(ids) > length and all(x == -100 for x in labels[1:length]) for ids, labels in alone)
    assert (cut, emptied) == (20, 10)
    with caplog.at_level(logging.INFO, logger="myproject"):
        splits = tokenized(data)
    said = re.findall(
        rf"(train|val): (\d+) of (\d+) examples were longer than data\.max_length={length} and cut; (\d+) of them",
        caplog.text,
    )
    counts = {split: [int(x) for x in numbers] for split, *numbers in said}
    assert sorted(counts) == ["train", "val"]
    assert sum(c[0] for c in counts.values()) == cut and sum(c[2] for c in counts.values()) == emptied
    assert {split: counts[split][1] - counts[split][2] for split in counts} == {
        s: len(e) for s, e in splits.items()
    }


def test_a_split_left_empty_is_refused_with_the_numbers_and_the_fix(instructions):
    long_prompt = {"prompt": "Reverse the word " + "kalo " * 30 + ".", "completion": "olak"}
    data = instructions([long_prompt] * 20, max_length=16)
    with pytest.raises(
        UserError,
        match=r"data\.max_length=16 leaves none of the 19 train examples a token to learn from \(they have \d+ to \d+ tokens.*raise data\.max_length",
    ):
        tokenized(data)
    with pytest.raises(
        UserError,
        match=r"holds 2 example\(s\) and data\.val_fraction=0\.9 holds out 2 for validation, leaving none to train on",
    ):
        tokenized(instructions([GOOD, GOOD], val_fraction=0.9))
    with pytest.raises(UserError, match=r"holds 0 example\(s\)"):
        tokenized(instructions(["", ""]))


# --------------------------------------------------------------------------------- tokenized once, keyed


def test_the_digest_follows_what_changes_the_tokens(instructions, tmp_path: Path):
    from hpctrain.data.tokens import source_digest

    def key(**settings) -> str:
        data = instructions([GOOD, GOOD], **settings)
        return source_digest(data.sources(), data.settings())

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "t.jinja").write_text(QWEN25)
    (tmp_path / "b" / "t.jinja").write_text(QWEN25)
    assert key() == key(fields={}) == key(chat_template=None)
    assert key(chat_template=str(tmp_path / "a" / "t.jinja")) == key(
        chat_template=str(tmp_path / "b" / "t.jinja")
    )
    keys = [
        key(),
        key(fields={"prompt": "question"}),
        key(fields={"prompt": "question", "completion": "answer"}),
        key(chat_template="chatml"),
        key(chat_template=str(tmp_path / "a" / "t.jinja")),
    ]
    (tmp_path / "a" / "t.jinja").write_text(QWEN25_MARKED)  # the same template, with the marks
    keys.append(key(chat_template=str(tmp_path / "a" / "t.jinja")))
    assert len(set(keys)) == len(keys)


# ------------------------------------------------------------------------------------------ the sample


@pytest.mark.slow  # a model: transformers' GPT-2 and Lightning imported
@pytest.mark.parametrize("base", ["gpt2", "qwen2.5"], ids=["no chat template", "chat template"])
def test_the_sample_after_validation_continues_plain_text_on_a_base_without_a_chat_template(
    tokenizers: dict[str, Path], base: str, caplog: pytest.LogCaptureFixture
):
    """A plain-text run on a base without a chat template: the sample callback continues the prompt as
    plain text (said in its line) where it raised before, and renders it as a chat where a template is."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from myproject.models.chat_sample import ChatSample

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizers[base]))
    torch.manual_seed(0)
    net = GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tokenizer), n_layer=1, n_head=2, n_embd=16, n_positions=128)
    )
    module = SimpleNamespace(net=net, device=torch.device("cpu"))
    trainer = SimpleNamespace(
        sanity_checking=False,
        datamodule=SimpleNamespace(tokenizer=tokenizer),
        current_epoch=0,
        global_rank=0,
        world_size=1,
        is_global_zero=True,
    )
    sample = ChatSample("Reverse the word kalo.", max_new_tokens=4, temperature=1.0, top_k=None)
    with caplog.at_level(logging.INFO, logger="myproject"):
        sample.on_validation_end(trainer, module)  # type: ignore[arg-type]
    assert sample.new_tokens and isinstance(sample.last, str)
    plain = (
        "sample after epoch 0 (plain text: the tokenizer has no chat template): Reverse the word kalo. -> "
    )
    chat = "sample after epoch 0: Reverse the word kalo. -> "
    assert (plain if base == "gpt2" else chat) in caplog.text


# --------------------------------------------------------------------------------------------- real runs


def _alpaca(records: list[dict]) -> list[dict]:
    """The demo's exchanges as alpaca lines: the word of "Reverse the word X." as the input."""
    lines = []
    for record in records:
        if "messages" in record:
            asked, answer = record["messages"][-2]["content"], record["messages"][-1]["content"]
        else:
            asked, answer = record["prompt"], record["completion"]
        instruction, _, word = asked.rpartition(" ") if asked.startswith("Reverse") else (asked, "", "")
        lines.append({"instruction": instruction, "input": word.rstrip("."), "output": answer})
    return lines


@pytest.mark.slow
def test_an_alpaca_file_trains_a_base_without_a_template_with_data_chat_template_chatml(tmp_path: Path):
    require_modules("transformers", "peft", "tokenizers", "safetensors", install="pip install -e '.[llm]'")
    from myproject.data import tiny_llm
    from myproject.data.chat import CHATML, digest

    tiny_llm.make(tmp_path / "model", chat_template=None)  # a pretrained base never tuned for chat
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text("".join(json.dumps(line) + "\n" for line in _alpaca(tiny_llm.instructions(count=120))))
    result = train(
        tmp_path / "logs",
        "experiment=lora_sft",
        "trainer=cpu",
        f"paths.data_dir={tmp_path / 'data'}",
        f"model.base.path={tmp_path / 'model' / 'base'}",
        f"data.path={alpaca}",
        "data.demo=false",
        "data.chat_template=chatml",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=3",
        "trainer.limit_val_batches=1",
        env={"PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert_ok(result)
    assert "the loss is on the assistant's tokens: as the chat template marks them" in result.stdout
    assert "sample after epoch 0: Reverse the word kalo. -> " in result.stdout
    (run,) = run_dirs(tmp_path / "logs")
    assert any(row.get("val/loss") for row in read_metrics(run))
    (manifest,) = (tmp_path / "data" / "tokenized").glob("instructions-*/manifest.json")
    assert json.loads(manifest.read_text())["tokens"]["settings"]["chat_template"] == digest(CHATML)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["every example cut away", "a message without content"])
def test_bad_data_ends_the_run_with_one_sentence_and_exit_2_before_training(tmp_path: Path, case: str):
    """Where a run completed without a step ("No training batches", exit 0) or ended in a Jinja traceback."""
    require_modules("transformers", "peft", "tokenizers", "safetensors", install="pip install -e '.[llm]'")
    from myproject.data import tiny_llm

    tiny_llm.make(tmp_path / "model")
    lines = tiny_llm.instructions(count=40)
    settings = ["data.max_length=4"] if case == "every example cut away" else []
    if case == "a message without content":
        lines[6] = {"messages": [{"role": "user"}, {"role": "assistant", "content": "olak"}]}
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = train(
        tmp_path / "logs",
        "experiment=lora_sft",
        "trainer=cpu",
        f"paths.data_dir={tmp_path / 'data'}",
        f"model.base.path={tmp_path / 'model' / 'base'}",
        f"data.path={data}",
        "data.demo=false",
        *settings,
        env={"PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    output = result.stdout
    says = {
        "every example cut away": r"data\.max_length=4 leaves none of the 38 train examples a token to learn from",
        "a message without content": rf"{re.escape(str(data))}:7: message 1 has no content",
    }[case]
    assert result.returncode == 2 and re.search(says, output), output[-3000:]
    assert "Traceback" not in output and "No training batches" not in output and "Epoch 0" not in output
