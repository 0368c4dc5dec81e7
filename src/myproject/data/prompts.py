"""Prompts to answer with a fine-tuned model: `python src/predict.py ckpt_path=... predict.input=prompts.jsonl`.

Each line of the file is one prompt, in the shapes of the instructions it was trained on:

    {"prompt": "Reverse the word kalo."}                       a user turn
    {"messages": [{"role": "system", ...}, {"role": "user", ...}]}   the conversation so far
    {"text": "Once upon"}                                      plain text, continued as it is

A turn is rendered with the chat template up to the assistant's answer (the generation prompt), as in
training. The batches are padded on the left, so every row's answer starts at the same column.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from hpctrain import UserError


class Prompts(Dataset):
    """The prompts of a .jsonl file, each as token ids and as the text it was given."""

    def __init__(self, path: Path, render: Callable[[dict[str, Any]], list[int]]) -> None:
        if not path.is_file():
            raise UserError(f"predict.input={path} does not exist; pass a .jsonl file of prompts.")
        self.records: list[dict[str, Any]] = []
        with open(path) as file:
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise UserError(
                        f"{path}:{number} is not JSON ({err.msg}); write one JSON object a line."
                    ) from err
                if not isinstance(record, dict) or not {"prompt", "messages", "text"} & record.keys():
                    raise UserError(
                        f"{path}:{number} has none of prompt, messages and text; write each line as "
                        '{"prompt": ...}, {"messages": [{"role": ..., "content": ...}, ...]} or {"text": ...}.'
                    )
                self.records.append(record)
        self.ids = [render(record) for record in self.records]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> int:
        return index


def shown(record: dict[str, Any]) -> str:
    """The prompt as the output file repeats it: its text, or the last turn of its conversation."""
    if "prompt" in record:
        return str(record["prompt"])
    if "messages" in record:
        return str(record["messages"][-1].get("content", ""))
    return str(record["text"])


def loader(
    path: Path, render: Callable[[dict[str, Any]], list[int]], pad_id: int, batch_size: int
) -> DataLoader:
    """Batches of {input_ids, attention_mask} padded on the left, and each row's prompt as text."""
    prompts = Prompts(path, render)

    def collate(indices: list[int]) -> dict[str, Any]:
        rows = [prompts.ids[i] for i in indices]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, tokens in enumerate(rows):
            ids[row, width - len(tokens) :] = torch.tensor(tokens, dtype=torch.long)
            mask[row, width - len(tokens) :] = 1
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "prompt": [shown(prompts.records[i]) for i in indices],
        }

    return DataLoader(prompts, batch_size=batch_size, collate_fn=collate)
