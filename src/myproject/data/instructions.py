"""Instruction data for a causal language model: `data=instructions`.

`path` is a `.jsonl` file, one example a line: chat messages, ShareGPT conversations, prompt/completion
pairs, alpaca's instruction/input/output, or plain text (`myproject.data.formats`; `fields` maps other
names onto these). Every line is read and checked before anything is tokenized: a bad one is one
sentence naming its file and line.

The tokenizer (`tokenizer`: a Hugging Face folder, usually the base model's) renders conversations with
its chat template, or with `chat_template` (a named template or a Jinja file) in its place; a base without
one is told so before anything is tokenized. `loss_on=assistant` takes the loss on the assistant's tokens
(`myproject.data.chat`: those the template marks with `{% generation %}`, or else each assistant turn's
text and what the template closes it with); `loss_on=all` on every token; plain text always on every
token. `packing=concat` (plain text: requires `loss_on=all`) fills rows of `max_length` tokens with
consecutive examples, each attending only to itself (its positions restart at 0); `packing=none` pads each
batch to its longest example. An example longer than `max_length` is cut, and one left without a token to
learn from is skipped: both counted and said per split, and a split left empty is one sentence.

Tokenized once into shards keyed by the digest of the data, the tokenizer's files and these settings,
staged per node, resumable mid-epoch: `hpctrain.data.TokenizedDataModule`. With `demo: true`, a missing
`path` and `tokenizer` are made first, offline (`myproject.data.tiny_llm`: experiment=lora_sft).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpctrain import UserError
from hpctrain.data import DataUnavailable, TokenizedDataModule, made_once
from myproject.data import chat, tiny_llm
from myproject.data.formats import Example, Line, check_fields, read_examples

log = logging.getLogger(__package__.split(".")[0])
IGNORE = chat.IGNORE
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
)
LOSS_ON = ("assistant", "all")
PACKING = ("none", "concat")


class InstructionsDataModule(TokenizedDataModule):
    name = "instructions"

    def __init__(
        self,
        path: str,
        tokenizer: str,
        cache_dir: str,
        max_length: int = 512,
        loss_on: str = "assistant",
        packing: str = "none",
        val_fraction: float = 0.05,
        batch_size: int = 8,
        fields: dict[str, str] | None = None,
        chat_template: str | None = None,
        demo: bool = False,
        stage_dir: str | None = None,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(cache_dir, batch_size, stage_dir, num_workers, pin_memory, seed)
        if loss_on not in LOSS_ON:
            raise UserError(
                f"data.loss_on={loss_on} is not one of {', '.join(LOSS_ON)}; pass data.loss_on=assistant or all."
            )
        if packing not in PACKING:
            raise UserError(
                f"data.packing={packing} is not one of {', '.join(PACKING)}; pass data.packing=none or concat."
            )
        if packing == "concat" and loss_on != "all":
            raise UserError(
                "data.packing=concat packs plain text and trains on every token, but data.loss_on=assistant; "
                "pass data.loss_on=all with it, or data.packing=none for chat data."
            )
        if not 0 < val_fraction < 1:
            raise UserError(f"data.val_fraction={val_fraction} must lie between 0 and 1 (e.g. 0.05).")
        self.path, self.tokenizer_path = Path(path).expanduser(), Path(tokenizer).expanduser()
        self.max_length, self.loss_on, self.packing = int(max_length), loss_on, packing
        self.val_fraction, self.demo = val_fraction, demo
        self.fields = check_fields(fields)
        self.chat_template = chat.chat_template(chat_template)  # None: the tokenizer's own
        self._tokenizer: Any = None
        self._pad_id: int | None = None

    def sources(self) -> list[Path]:
        return [self.path] + [
            self.tokenizer_path / f for f in TOKENIZER_FILES if (self.tokenizer_path / f).is_file()
        ]

    def settings(self) -> dict[str, Any]:
        return {
            "format": 2,
            "max_length": self.max_length,
            "loss_on": self.loss_on,
            "packing": self.packing,
            "val_fraction": self.val_fraction,
            "fields": dict(sorted(self.fields.items())),
            "chat_template": chat.digest(self.chat_template),
        }

    def check_available(self) -> None:
        if self.demo and not (self.path.is_file() and (self.tokenizer_path / "tokenizer.json").is_file()):
            folder = self.path.parent
            if made_once(folder, tiny_llm.make, marker=self.path.name):
                log.info("made the demo base model and instructions in %s", folder)
        if not self.path.is_file():
            raise DataUnavailable(
                f'data.path={self.path} does not exist; pass a .jsonl file of instructions (one {{"messages": '
                '[...]}, {"prompt", "completion"}, {"instruction", "output"} or {"text"} object a line).'
            )
        if not any((self.tokenizer_path / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
            raise DataUnavailable(
                f"data.tokenizer={self.tokenizer_path} holds no tokenizer.json; pass the base model's folder "
                "(data.tokenizer=${model.base.path})."
            )
        super().check_available()

    @property
    def tokenizer(self) -> Any:
        """The data's tokenizer, with `data.chat_template` as its chat template where one is given."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_path), trust_remote_code=False)
            if self.chat_template is not None:
                self._tokenizer.chat_template = self.chat_template
        return self._tokenizer

    @property
    def pad_id(self) -> int:
        if self._pad_id is None:
            tokens = self.tokenizer
            found = tokens.pad_token_id if tokens.pad_token_id is not None else tokens.eos_token_id
            self._pad_id = int(found if found is not None else 0)
        return self._pad_id

    def tokenize(self) -> dict[str, Iterator[tuple[list[int], list[int], list[int]]]]:
        examples = read_examples(self.path, self.fields)
        self._check_template(examples)
        count = len(examples)
        held = max(1, round(count * self.val_fraction))
        if count - held < 1:
            raise UserError(
                f"data.path={self.path} holds {count} example(s) and data.val_fraction={self.val_fraction} holds out "
                f"{held} for validation, leaving none to train on; add lines or lower data.val_fraction."
            )
        order = list(range(count))
        random.Random(0).shuffle(order)  # which examples validate: fixed by the data, not the run's seed
        chosen = {"train": sorted(order[held:]), "val": sorted(order[:held])}
        return {
            split: self._examples([examples[i] for i in numbers], split) for split, numbers in chosen.items()
        }

    def _check_template(self, examples: list[Example]) -> None:
        """A conversation needs a chat template: one sentence, before anything is tokenized; says which rule
        decides the loss."""
        first = next((e for e in examples if e.messages is not None), None)
        if first is None:
            return
        if not self.tokenizer.chat_template:
            raise UserError(
                f"{self.path}:{first.line} is a conversation, but the tokenizer in data.tokenizer={self.tokenizer_path} "
                "has no chat template to render it; pass data.chat_template=chatml (or a Jinja file of yours)."
            )
        if self.loss_on == "assistant":
            rule = (
                "as the chat template marks them ({% generation %})"
                if chat.marked(self.tokenizer)
                else ("each assistant turn's text and what the chat template closes it with")
            )
            log.info("the loss is on the assistant's tokens: %s", rule)

    def _examples(
        self, examples: list[Example], split: str
    ) -> Iterator[tuple[list[int], list[int], list[int]]]:
        pieces = (self._tokens(example) for example in examples)
        if self.packing == "concat":
            yield from _packed(pieces, self.max_length)
            return
        cut = skipped = longest = 0
        shortest = None
        for ids, labels in pieces:
            longest, shortest = max(longest, len(ids)), min(shortest or len(ids), len(ids))
            if len(ids) > self.max_length:
                cut += 1
                ids, labels = ids[: self.max_length], labels[: self.max_length]
            if all(label == IGNORE for label in labels[1:]):
                skipped += 1  # nothing left to learn from once cut
                continue
            yield ids, labels, list(range(len(ids)))
        if skipped == len(examples):
            raise UserError(
                f"data.max_length={self.max_length} leaves none of the {len(examples)} {split} examples a token to "
                f"learn from (they have {shortest} to {longest} tokens, and what comes before the "
                "assistant's answer fills the rest); raise data.max_length."
            )
        if cut:
            log.info(
                "%s: %d of %d examples were longer than data.max_length=%d and cut; %d of them left nothing to "
                "learn from and were skipped",
                split,
                cut,
                len(examples),
                self.max_length,
                skipped,
            )

    def predict_input(self, path: Path, batch_size: int) -> Any:
        """src/predict.py predict.input=<prompts.jsonl>: each prompt rendered as a conversation up to the
        assistant's answer (myproject.data.prompts)."""
        from myproject.data import prompts

        def render(record: dict[str, Any]) -> list[int]:
            if "text" in record and "messages" not in record:
                return self.tokenizer(record["text"], add_special_tokens=True)["input_ids"]
            messages = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
            return chat.prompt_tokens(self.tokenizer, messages)

        return prompts.loader(path, render, self.pad_id, batch_size)

    def tokens(self, record: dict[str, Any]) -> tuple[list[int], list[int]]:
        """One record's token ids and labels (IGNORE where no loss is taken), as a line of the file is read."""
        return self._tokens(Line(record, self.fields, str(self.path)).example(0))

    def _tokens(self, example: Example) -> tuple[list[int], list[int]]:
        tokens = self.tokenizer
        if example.messages is None:
            ids = tokens(example.text, add_special_tokens=True)["input_ids"]
            if tokens.eos_token_id is not None:
                ids = [*ids, tokens.eos_token_id]
            return ids, list(ids)
        return chat.chat_tokens(tokens, example.messages, f"{self.path}:{example.line}", self.loss_on)


def _packed(
    pieces: Iterator[tuple[list[int], list[int]]], length: int
) -> Iterator[tuple[list[int], list[int], list[int]]]:
    """Rows of `length` tokens filled with consecutive examples; positions restart where each begins."""
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for piece_ids, piece_labels in pieces:
        for start in range(0, len(piece_ids), length):  # an example longer than a row goes on in the next
            chunk = piece_ids[start : start + length]
            while chunk:
                room = length - len(ids)
                ids += chunk[:room]
                labels += piece_labels[start : start + len(chunk)][:room]
                positions += list(range(len(chunk[:room])))
                start, chunk = start + room, chunk[room:]
                if len(ids) == length:
                    yield ids, labels, positions
                    ids, labels, positions = [], [], []
    if ids:
        yield ids, labels, positions
