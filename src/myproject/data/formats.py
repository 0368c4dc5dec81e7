"""The lines of an instructions file (`data=instructions`): the shapes a line may have, each read as a
conversation or as plain text; a bad line is one sentence naming its file and line.

    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}
    {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}     ShareGPT
    {"prompt": ..., "completion": ...}                  a user turn and the assistant's answer
    {"instruction": ..., "input": ..., "output": ...}   alpaca: a user turn of the instruction, a blank
                                                        line and the input (when not empty), and the
                                                        assistant's output
    {"text": ...}                                       plain text

A line is read as the first of these shapes it has; its other fields are ignored. ShareGPT's roles are
named as chat templates name them (`human` -> user, `gpt` -> assistant); other roles are left to the chat
template, which may refuse them. A message's other keys (`name`, `tool_calls`, ...) reach the template.

`fields` (`data.fields`) names the fields where a file calls them otherwise: `{prompt: question,
completion: answer}` reads `question` as the prompt; `{messages: dialog, role: speaker, content: text}`
reads the conversation from `dialog`, each message's role from `speaker` and its text from `text`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain import UserError

FIELDS = ("messages", "role", "content", "prompt", "completion", "instruction", "input", "output", "text")
ROLES = {"human": "user", "gpt": "assistant"}  # ShareGPT's names for the roles chat templates know
SHAPES = '{"messages": [...]}, {"conversations": [...]}, {"prompt", "completion"}, {"instruction", "output"} or {"text"}'


@dataclass(frozen=True)
class Example:
    """One line of the file: a conversation (`messages`, roles and contents as strings) or plain `text`."""

    line: int
    messages: list[dict[str, Any]] | None = None
    text: str | None = None


def check_fields(fields: dict[str, str] | None) -> dict[str, str]:
    """`data.fields` as {field: the file's name for it}; one sentence if a key is not a field."""
    fields = dict(fields or {})
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise UserError(
            f"data.fields names {', '.join(unknown)}, which is not a field of an example; map your names onto "
            f"{', '.join(FIELDS)}, e.g. data.fields={{prompt:question,completion:answer}}."
        )
    wrong = sorted(k for k, v in fields.items() if not isinstance(v, str) or not v)
    if wrong:
        raise UserError(
            f"data.fields.{wrong[0]}={fields[wrong[0]]!r} is not a field name; give the name your lines use."
        )
    return fields


def read_examples(path: Path, fields: dict[str, str]) -> list[Example]:
    """Every line of `path` read, in order (empty lines skipped); the first bad one is one sentence."""
    examples = []
    with open(path, "rb") as file:
        for number, raw in enumerate(file, 1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise UserError(f"{where} is not UTF-8 text ({err.reason}); save the file as UTF-8.") from err
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{where} is not JSON ({err.msg}); write one JSON object a line.") from err
            examples.append(Line(record, fields, where).example(number))
    return examples


class Line:
    """One parsed line, its fields read through `fields`."""

    def __init__(self, record: Any, fields: dict[str, str], where: str) -> None:
        if not isinstance(record, dict):
            raise UserError(
                f"{where} is a JSON {type(record).__name__}, not an object; write each line as {SHAPES}."
            )
        self.record, self.fields, self.where = record, fields, where

    def name(self, field: str) -> str:
        return self.fields.get(field, field)

    def has(self, field: str) -> bool:
        return self.name(field) in self.record

    def string(self, field: str, empty: bool = False) -> str:
        """The field's value: a string, not empty unless `empty`."""
        value = self.record.get(self.name(field))
        if isinstance(value, list) and field in ("prompt", "completion"):  # TRL's conversational pairs
            raise UserError(
                f"{self.where}: {self.name(field)} is a list of messages; write the whole conversation as "
                '{"messages": [...]} (the loss is on its assistant messages).'
            )
        if not isinstance(value, str):
            raise UserError(
                f"{self.where}: {self.name(field)} is {_kind(value)}, not a string; write it as text."
            )
        if not empty and not value.strip():
            raise UserError(f"{self.where}: {self.name(field)} is empty; give it text or leave the line out.")
        return value

    def example(self, number: int) -> Example:
        listed = (
            self.name("messages")
            if "messages" in self.fields
            else next((k for k in ("messages", "conversations") if k in self.record), None)
        )
        if listed is not None and listed in self.record:
            return Example(number, messages=self.messages(listed))
        for first, second in (("prompt", "completion"), ("instruction", "output")):
            if self.has(first) or self.has(second):
                missing = second if self.has(first) else first
                if not self.has(missing):
                    present = self.name(first if missing == second else second)
                    raise UserError(
                        f"{self.where} has {present} but no {self.name(missing)}; give both"
                        + (
                            f" (or map your name with data.fields.{missing})."
                            if missing not in self.fields
                            else "."
                        )
                    )
                return Example(number, messages=self.pair(first, second))
        if self.has("text"):
            return Example(number, text=self.string("text"))
        keys = ", ".join(sorted(map(str, self.record))) or "no field"
        raise UserError(
            f"{self.where} has none of the known shapes ({SHAPES}) but {keys}; write it in one of them or map "
            "your names with data.fields, e.g. data.fields={prompt:question,completion:answer}."
        )

    def pair(self, first: str, second: str) -> list[dict[str, Any]]:
        """prompt/completion or alpaca's instruction/input/output as a user turn and the assistant's."""
        asked = self.string(first)
        if first == "instruction" and self.record.get(self.name("input")) is not None:
            extra = self.string("input", empty=True)
            asked = f"{asked}\n\n{extra}" if extra.strip() else asked
        return [{"role": "user", "content": asked}, {"role": "assistant", "content": self.string(second)}]

    def messages(self, listed: str) -> list[dict[str, Any]]:
        value = self.record[listed]
        if not isinstance(value, list) or not value:
            raise UserError(
                f"{self.where}: {listed} is {_kind(value) if value != [] else 'an empty list'}; write it as a "
                "list of messages, "
                '[{"role": "user", "content": ...}, {"role": "assistant", "content": ...}].'
            )
        return [self.message(i, m) for i, m in enumerate(value, 1)]

    def message(self, index: int, message: Any) -> dict[str, Any]:
        """One message as {"role", "content", other keys}: its keys through `fields` (role and content, or
        ShareGPT's from and value), its role named as chat templates name it."""
        if not isinstance(message, dict):
            raise UserError(
                f"{self.where}: message {index} is {_kind(message)}, not an object with a role and content."
            )
        sharegpt = not {"role", "content"} & message.keys() and bool({"from", "value"} & message.keys())
        role_key = self.fields.get("role") or ("from" if sharegpt else "role")
        content_key = self.fields.get("content") or ("value" if sharegpt else "content")
        for key, field in ((role_key, "role"), (content_key, "content")):
            if message.get(key) is None:
                mapped = f" (data.fields.{field})" if field in self.fields else ""
                raise UserError(
                    f"{self.where}: message {index} has no {key}{mapped}; give every message a role and a content, "
                    '{"role": "user", "content": ...}.'
                )
        role, content = message[role_key], message[content_key]
        if not isinstance(role, str) or not role:
            raise UserError(
                f"{self.where}: message {index}'s {role_key} is {_kind(role)}; name a role (user, assistant, system)."
            )
        if not isinstance(content, str):
            raise UserError(
                f"{self.where}: message {index}'s {content_key} is {_kind(content)}, not a string; write it as text."
            )
        role = ROLES.get(role, role)
        if role != "system" and not content.strip():
            raise UserError(
                f"{self.where}: message {index} ({role}) is empty; give it text or leave the message out."
            )
        rest = {k: v for k, v in message.items() if k not in (role_key, content_key)}
        return {**rest, "role": role, "content": content}


def _kind(value: Any) -> str:
    """What a JSON value is, in words: `a number (3)`, `null`, `a list`."""
    if value is None:
        return "null"
    names = {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }
    kind = names.get(type(value), type(value).__name__)
    return f"{kind} ({value!r})" if isinstance(value, (bool, int, float)) else kind
