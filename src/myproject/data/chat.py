"""Conversations as tokens: the chat template that renders them, and which of their tokens the loss is on.

`data.chat_template` replaces the tokenizer's template (or gives one to a base without): a named template
(`NAMED`: `chatml`) or a Jinja file, as a model folder's `chat_template.jinja` is written.

With `data.loss_on=assistant` the loss is on the assistant's tokens, found by one of two rules:
- the template marks them (`{% generation %}` ... `{% endgeneration %}`): the marked tokens, exactly as
  transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)` gives them (TRL's
  `assistant_only_loss`);
- otherwise, for each assistant turn: the text the template renders for the conversation up to and with
  that turn, after the text it renders for the conversation before it with the generation prompt, for as
  long as it agrees with the whole conversation's text. That is the turn's text and what the template
  closes it with (an end-of-turn token, a newline), and not the role's header the generation prompt gives.
  A template that renders the conversation before a turn otherwise on its own than inside the whole one
  (Mistral v0.3's puts the system message in the last user turn) is one sentence: it needs marks.
A token counts if any of its characters lies in what counts.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from hpctrain import UserError

IGNORE = -100
MARKS = re.compile(r"\{%-?\s*generation\s*-?%\}")  # as transformers finds them

# ChatML, as Qwen2.5 and most fine-tunes of bases without a template write it; its markers are single
# tokens where the tokenizer has them (<|im_start|>, <|im_end|>) and plain text where it has not.
CHATML = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- generation %}{{- message['content'] + '<|im_end|>\\n' }}{%- endgeneration %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
NAMED = {"chatml": CHATML}


def chat_template(value: str | None) -> str | None:
    """The text of `data.chat_template`: a named template or a Jinja file; None: the tokenizer's own."""
    if value is None or value == "":
        return None
    if value in NAMED:
        return NAMED[value]
    path = Path(value).expanduser()
    if not path.is_file():
        raise UserError(
            f"data.chat_template={value} is neither a named template ({', '.join(NAMED)}) nor a file; pass "
            "data.chat_template=chatml or the path of a Jinja file (as a model folder's chat_template.jinja)."
        )
    return path.read_text(encoding="utf-8")


def digest(template: str | None) -> str | None:
    """What the settings hold of a template: its text's sha256 (a changed file tokenizes again)."""
    return None if template is None else hashlib.sha256(template.encode()).hexdigest()[:16]


def marked(tokenizer: Any) -> bool:
    """Whether the tokenizer's template marks the assistant's tokens."""
    return bool(MARKS.search(tokenizer.get_chat_template()))


def chat_tokens(
    tokenizer: Any, messages: list[dict[str, Any]], where: str, loss_on: str
) -> tuple[list[int], list[int]]:
    """A conversation's token ids and labels (IGNORE where no loss is taken); `where` names its line."""
    if loss_on == "assistant" and not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(dict.fromkeys(m["role"] for m in messages))
        raise UserError(
            f"{where}: the conversation has no assistant message (its roles: {roles}), so nothing in it is "
            "learned; give it the assistant's answer (ShareGPT's gpt), or pass data.loss_on=all."
        )
    try:
        if loss_on == "assistant" and marked(tokenizer):
            out = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids, counted = list(out["input_ids"]), list(out["assistant_masks"])
        else:
            text = _render(tokenizer, messages)
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(encoded["input_ids"])
            if loss_on == "all":
                return ids, list(ids)
            offsets = encoded["offset_mapping"]
            spans = _turns(tokenizer, messages, text, [e for _, e in offsets], where)
            counted = [any(s < end and e > start for start, end in spans) for s, e in offsets]
    except (ValueError, TypeError, *_template_errors()) as err:
        raise UserError(
            f"{where}: the chat template refuses this conversation ({err}); change the line, or give a template "
            "that takes it (data.chat_template)."
        ) from err
    if not any(counted):
        raise UserError(
            f"{where}: the chat template marks none of this conversation's tokens as the assistant's; mark the "
            "assistant's text in it with {% generation %} ... {% endgeneration %}."
        )
    return ids, [token if count else IGNORE for token, count in zip(ids, counted, strict=True)]


def _turns(
    tokenizer: Any, messages: list[dict[str, Any]], text: str, token_ends: list[int], where: str
) -> list[tuple[int, int]]:
    """The characters of `text` (the whole conversation) that count: each assistant turn's (module
    docstring); `token_ends`: where each of its tokens ends."""
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if turn == 0:
            raise UserError(
                f"{where}: the conversation opens with the assistant's message, which answers nothing; begin it "
                "with a user (or system) message."
            )
        before = _render(tokenizer, messages[:turn], prompt=True)
        with_it = _render(tokenizer, messages[: turn + 1])
        end = len(with_it)
        if not text.startswith(with_it):  # the template closes the conversation otherwise than a turn (Phi-3)
            pairs = enumerate(zip(with_it, text, strict=False))
            agreed = next((i for i, (a, b) in pairs if a != b), min(len(with_it), len(text)))
            end = max((e for e in token_ends if e <= agreed), default=0)  # whole tokens only
        if not (text.startswith(before) and with_it.startswith(before)) or end <= len(before):
            raise UserError(
                f"{where}: the chat template renders the conversation before message {turn + 1} (with its "
                "generation prompt) otherwise on its own than inside the whole conversation, so the assistant's "
                "tokens cannot be told from the rest; give data.chat_template a template that marks them with "
                "{% generation %} ... {% endgeneration %}, or pass data.loss_on=all."
            )
        spans.append((len(before), end))
    return spans


def prompt_tokens(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The conversation so far rendered up to the assistant's answer (its generation prompt): what a model
    continues at inference, tokenized as training tokenizes a conversation."""
    return list(tokenizer(_render(tokenizer, messages, prompt=True), add_special_tokens=False)["input_ids"])


def _render(tokenizer: Any, messages: list[dict[str, Any]], prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


def _template_errors() -> tuple[type[Exception], ...]:
    from jinja2 import TemplateError

    return (TemplateError,)
