"""Instruction data for a causal language model: `data=instructions`.

`path` is a `.jsonl` file, one example a line, in one of three shapes:

    {"messages": [{"role": "system", "content": ...}, {"role": "user", ...}, {"role": "assistant", ...}]}
    {"prompt": "...", "completion": "..."}           (a user turn and the assistant's answer)
    {"text": "..."}                                  (plain text)

The tokenizer (`tokenizer`: a Hugging Face folder, usually the base model's) renders messages with its
chat template. `loss_on=assistant` takes the loss on the assistant's tokens only: each assistant turn's
tokens are found as what the template adds after the conversation before it, so any template works
(no `{% generation %}` markers needed); `loss_on=all` on every token. `packing=concat` (plain text:
requires `loss_on=all`) fills rows of `max_length` tokens with consecutive examples, each attending only
to itself (its positions restart at 0); `packing=none` pads each batch to its longest example. An example
longer than `max_length` is cut, and one left without a token to learn from is skipped (and counted).

Tokenized once into shards keyed by the digest of the data, the tokenizer's files and these settings,
staged per node, resumable mid-epoch: `hpctrain.data.TokenizedDataModule`. With `demo: true`, a missing
`path` and `tokenizer` are made first, offline (`myproject.data.tiny_llm`: experiment=lora_sft).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpctrain import UserError
from hpctrain.data import DataUnavailable, TokenizedDataModule, made_once
from myproject.data import tiny_llm

log = logging.getLogger(__package__.split(".")[0])
IGNORE = -100
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
        demo: bool = False,
        stage_dir: str | None = None,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(cache_dir, batch_size, stage_dir, num_workers, pin_memory, seed)
        if loss_on not in LOSS_ON:
            raise UserError(f"data.loss_on={loss_on} is not one of {', '.join(LOSS_ON)}; pass data.loss_on=assistant or all.")
        if packing not in PACKING:
            raise UserError(f"data.packing={packing} is not one of {', '.join(PACKING)}; pass data.packing=none or concat.")
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
        self._tokenizer: Any = None
        self._pad_id: int | None = None

    def sources(self) -> list[Path]:
        return [self.path] + [self.tokenizer_path / f for f in TOKENIZER_FILES if (self.tokenizer_path / f).is_file()]

    def settings(self) -> dict[str, Any]:
        return {
            "format": 1,
            "max_length": self.max_length,
            "loss_on": self.loss_on,
            "packing": self.packing,
            "val_fraction": self.val_fraction,
        }

    def check_available(self) -> None:
        if self.demo and not (self.path.is_file() and (self.tokenizer_path / "tokenizer.json").is_file()):
            folder = self.path.parent
            if made_once(folder, tiny_llm.make, marker=self.path.name):
                log.info("made the demo base model and instructions in %s", folder)
        if not self.path.is_file():
            raise DataUnavailable(
                f"data.path={self.path} does not exist; pass a .jsonl file of instructions (one {{\"messages\": "
                "[...]}, {\"prompt\", \"completion\"} or {\"text\"} object a line)."
            )
        if not any((self.tokenizer_path / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
            raise DataUnavailable(
                f"data.tokenizer={self.tokenizer_path} holds no tokenizer.json; pass the base model's folder "
                "(data.tokenizer=${model.base.path})."
            )
        super().check_available()

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_path), trust_remote_code=False)
        return self._tokenizer

    @property
    def pad_id(self) -> int:
        if self._pad_id is None:
            tokens = self.tokenizer
            found = tokens.pad_token_id if tokens.pad_token_id is not None else tokens.eos_token_id
            self._pad_id = int(found if found is not None else 0)
        return self._pad_id

    def tokenize(self) -> dict[str, Iterator[tuple[list[int], list[int], list[int]]]]:
        records = self._records()
        order = list(range(len(records)))
        random.Random(0).shuffle(order)  # which examples validate: fixed by the data, not the run's seed
        held = max(1, round(len(records) * self.val_fraction))
        chosen = {"train": sorted(order[held:]), "val": sorted(order[:held])}
        return {split: self._examples([records[i] for i in numbers], split) for split, numbers in chosen.items()}

    def _records(self) -> list[dict[str, Any]]:
        records = []
        with open(self.path) as file:
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise UserError(f"{self.path}:{number} is not JSON ({err.msg}); write one JSON object a line.") from err
                if not isinstance(record, dict) or not ({"messages", "text"} & record.keys() or {"prompt", "completion"} <= record.keys()):
                    raise UserError(
                        f"{self.path}:{number} has none of messages, prompt and completion, or text; write each "
                        'line as {"messages": [{"role": ..., "content": ...}, ...]}, {"prompt": ..., "completion": ...} '
                        'or {"text": ...}.'
                    )
                records.append(record)
        if len(records) < 2:
            raise UserError(f"{self.path} holds {len(records)} example(s); at least 2 are needed (train and val).")
        return records

    def _examples(self, records: list[dict[str, Any]], split: str) -> Iterator[tuple[list[int], list[int], list[int]]]:
        skipped = 0
        pieces = (self.tokens(record) for record in records)
        if self.packing == "concat":
            yield from _packed(pieces, self.max_length)
            return
        for ids, labels in pieces:
            ids, labels = ids[: self.max_length], labels[: self.max_length]
            if all(label == IGNORE for label in labels[1:]):
                skipped += 1  # nothing left to learn from once cut (or an empty answer)
                continue
            yield ids, labels, list(range(len(ids)))
        if skipped:
            log.info("%s: %d example(s) skipped: no token to learn from within data.max_length=%d", split, skipped, self.max_length)

    def predict_input(self, path: Path, batch_size: int) -> Any:
        """src/predict.py predict.input=<prompts.jsonl>: each prompt rendered as a conversation up to the
        assistant's answer (myproject.data.prompts)."""
        from myproject.data import prompts

        def render(record: dict[str, Any]) -> list[int]:
            if "text" in record and "messages" not in record:
                return self.tokenizer(record["text"], add_special_tokens=True)["input_ids"]
            return self._chat(record.get("messages") or [{"role": "user", "content": record["prompt"]}], prompt=True)

        return prompts.loader(path, render, self.pad_id, batch_size)

    def tokens(self, record: dict[str, Any]) -> tuple[list[int], list[int]]:
        """One record's token ids and labels (IGNORE where no loss is taken)."""
        tokens = self.tokenizer
        if "text" in record and "messages" not in record:
            ids = tokens(record["text"], add_special_tokens=True)["input_ids"]
            if tokens.eos_token_id is not None:
                ids = [*ids, tokens.eos_token_id]
            return ids, list(ids)
        messages = record.get("messages") or [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["completion"]},
        ]
        ids = self._chat(messages)
        if self.loss_on == "all":
            return ids, list(ids)
        labels = [IGNORE] * len(ids)
        for turn, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            start = len(self._chat(messages[:turn], prompt=True))
            end = len(self._chat(messages[: turn + 1]))
            labels[start:end] = ids[start:end]
        return ids, labels

    def _chat(self, messages: list[dict[str, Any]], prompt: bool = False) -> list[int]:
        if not messages:
            return []
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt, return_dict=True)
        return list(rendered["input_ids"])


def _packed(pieces: Iterator[tuple[list[int], list[int]]], length: int) -> Iterator[tuple[list[int], list[int], list[int]]]:
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
