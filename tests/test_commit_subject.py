"""The project's commit-msg hook (.pre-commit-config.yaml) refuses a subject over 72 characters: pre-commit's
pygrep fails a file in which its pattern is found, searched with re.MULTILINE (`--multiline`)."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.helpers import ROOT


def _hook() -> dict:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    return {hook["id"]: hook for repo in config["repos"] for hook in repo["hooks"]}["commit-subject"]


@pytest.mark.parametrize(
    ("message", "refused"),
    [
        ("Sharded runs: text on every rank\n\nThe body may be as long as it likes " + "x" * 200, False),
        ("x" * 72 + "\n", False),
        ("x" * 73 + "\n", True),
        ("x" * 73, True),
    ],
)
def test_the_commit_msg_hook_refuses_a_subject_over_72_characters(message: str, refused: bool):
    hook = _hook()
    assert (
        hook["stages"] == ["commit-msg"] and hook["language"] == "pygrep" and hook["args"] == ["--multiline"]
    )
    assert (re.compile(hook["entry"], re.MULTILINE).search(message) is not None) == refused
