"""The contributor's recipes in docs/maintainers/contributing.md, followed in a copy of the project: each
touches the two files it names, and the result works (a callback runs in a training run beside the
default set; a cluster preset key is read, checked, and in the editor schema)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers import PYTHON, ROOT, local_env

pytestmark = pytest.mark.slow

PAGE = ROOT / "docs" / "maintainers" / "contributing.md"


def _copy(project: Path, *parts: str) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "local")
    for part in parts:
        source = ROOT / part
        if source.is_dir():
            shutil.copytree(source, project / part, ignore=ignore)
        else:
            (project / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, project / part)
    return project


def _recipe(title: str) -> str:
    """The page's section `### <title>`."""
    found = re.search(rf"^### {re.escape(title)}\n(.*?)(?=^##)", PAGE.read_text(), re.MULTILINE | re.DOTALL)
    assert found, title
    return found.group(1)


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.DOTALL)


def _run(project: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**local_env(), "PYTHONPATH": str(project / "src"), "HPCTRAIN_CODE_ROOT": str(project)}
    return subprocess.run([PYTHON, *args], cwd=project, env=env, capture_output=True, text=True, timeout=300)


def _changed(project: Path) -> set[str]:
    """The files of the copy that differ from this checkout's (added or edited)."""
    changed = set()
    for path in project.rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            relative = path.relative_to(project)
            original = ROOT / relative
            if not original.is_file() or original.read_bytes() != path.read_bytes():
                changed.add(str(relative))
    return changed


def test_the_add_a_callback_recipe_runs_its_callback_beside_the_default_set(tmp_path: Path):
    recipe = _recipe("Add a callback")
    project = _copy(tmp_path / "project", "conf", "src", "pyproject.toml")
    for source, title in re.findall(r'^<!-- code: (\S+) -->\n```\w+ title="([^"]+)"', recipe, re.MULTILINE):
        (project / title).write_text((ROOT / source).read_text())  # the page's files, where it puts them
    assert _changed(project) == {
        "src/hpctrain/callbacks/epoch_marks.py",
        "src/hpctrain/conf/callbacks/epoch_marks.yaml",
    }
    (command,) = re.findall(r"^python (src/train\.py .*callbacks=\S+.*)$", _blocks(recipe, "bash")[0], re.M)
    args = [*command.split(), f"hydra.run.dir={tmp_path / 'run'}"]
    composed = _run(project, *args, "--cfg", "job")
    assert composed.returncode == 0, composed.stderr[-3000:]
    callbacks = yaml.safe_load(composed.stdout)["callbacks"]
    assert {"epoch_marks", "model_checkpoint", "performance"} <= set(callbacks)  # added to the default set
    trained = _run(project, *args)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert (tmp_path / "run" / "epochs.txt").read_text().splitlines() == ["epoch 0"]


def test_the_add_a_preset_key_recipe_reads_checks_and_documents_the_key(tmp_path: Path):
    recipe = _recipe("Add a preset key")
    (field,) = re.findall(r"`(constraint: .*?)`\.", recipe, re.DOTALL)
    project = _copy(tmp_path / "project", "src/hpctrain", "scripts/dev")
    settings = project / "src/hpctrain/runtime/config/settings.py"
    text = settings.read_text()
    anchor = "    setup: list[str] = setting("  # the recipe adds its field to the Cluster dataclass
    assert anchor in text
    settings.write_text(text.replace(anchor, f"    {field}\n{anchor}", 1))
    regenerated = _run(project, "scripts/dev/config_schema.py")
    assert regenerated.returncode == 0, regenerated.stderr[-3000:]
    schema = json.loads((project / "src/hpctrain/conf/schema/cluster.schema.json").read_text())
    assert "constraint" in json.dumps(schema)
    preset = tmp_path / "site.yaml"  # a site's preset (conf/cluster/<name>.yaml)
    preset.write_text("name: site\npartition: gpu\nconstraint: a100\n")
    typo = tmp_path / "typo.yaml"
    typo.write_text("name: typo\nconstrant: a100\n")
    load = "from pathlib import Path; from hpctrain.runtime.config.settings import Cluster; "
    read = _run(project, "-c", load + f"print(Cluster.load(Path({str(preset)!r})).constraint)")
    assert read.returncode == 0 and read.stdout.strip() == "a100", read.stderr[-3000:]
    refused = _run(project, "-c", load + f"Cluster.load(Path({str(typo)!r}))")
    assert refused.returncode != 0 and "constrant" in refused.stderr and "constraint" in refused.stderr
    assert _changed(project) == {  # the recipe's one hand edit, and what its command regenerates
        "src/hpctrain/runtime/config/settings.py",
        "src/hpctrain/conf/schema/cluster.schema.json",
        "src/hpctrain/conf/schema/train.schema.json",  # a preset is the train config's `cluster` too
    }
