"""A new project from the template (copier copy): the user's package named after it, hpctrain carried
untouched and recorded, a README, tests and CI of its own; and `copier update` bringing hpctrain's next
version without touching a file of the user's. (This file stays in the template: copier.yml excludes tests/.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hpctrain.testing import untouched
from tests.helpers import PYTHON, ROOT, local_env

pytestmark = pytest.mark.slow

COPIER = str(Path(PYTHON).with_name("copier"))
GIT = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost"]
TEMPLATE_PACKAGE = "myproject"


def _run(command: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 600):
    result = subprocess.run(
        command, cwd=cwd, env=env or local_env(), capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{command}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.fixture
def template(tmp_path: Path) -> Path:
    """This working tree (tracked and untracked, not ignored) as a template git repository."""
    repo = tmp_path / "template"
    listed = _run(["git", "ls-files", "-co", "--exclude-standard", "-z"], ROOT).stdout.split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    _run(["git", "init", "-q"], repo)
    _run([*GIT, "add", "-A"], repo)
    _run([*GIT, "commit", "-qm", "A"], repo)
    return repo


def _generate(template: Path, destination: Path, *answers: str) -> Path:
    _run(
        [COPIER, "copy", "--trust", "--defaults", "--quiet", *answers, str(template), str(destination)],
        destination.parent,
    )
    return destination


def _traces(project: Path, name: str) -> list[str]:
    pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(name)}(?![A-Za-z0-9])", re.IGNORECASE)
    found = []
    for path in project.rglob("*"):
        if ".git" in path.relative_to(project).parts:
            continue
        if pattern.search(path.name) or (
            path.is_file() and pattern.search(path.read_bytes().decode(errors="ignore"))
        ):
            found.append(str(path.relative_to(project)))
    return found


def _files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.name != "files.sha256"
    }


@pytest.mark.parametrize("examples", ["true", "false"])
def test_a_generated_project_is_the_users_and_carries_hpctrain_untouched(
    template: Path, tmp_path: Path, examples: str
):
    project = _generate(
        template,
        tmp_path / "deep-sea",
        *("-d", "project_name=Deep Sea", "-d", "package_name=deep_sea", "-d", "author=Ada"),
        *("-d", f"examples={examples}"),
    )
    # the user's package is named after the project, and the template's name is left nowhere
    assert _traces(project, TEMPLATE_PACKAGE) == []
    assert (project / "src" / "deep_sea" / "models" / "classifier.py").is_file()
    assert (project / "src" / "deep_sea" / "examples").is_dir() == (examples == "true")
    assert (
        "_target_: deep_sea.models.classifier.ImageClassifier"
        in (project / "conf/model/mnist_cnn.yaml").read_text()
    )
    pyproject = (project / "pyproject.toml").read_text()
    assert 'name = "deep_sea"' in pyproject and 'authors = [{ name = "Ada" }]' in pyproject
    assert "#SBATCH --job-name=deep_sea\n" in (project / "slurm" / "train.sbatch").read_text()

    # hpctrain and its plugins: the template's, byte for byte, and recorded
    for carried in ("src/hpctrain", "src/hydra_plugins"):
        assert _files(project / carried) == _files(template / carried), carried
    assert untouched.check(project / "src") is None
    assert (project / "src/hpctrain/files.sha256").read_text().startswith("# hpctrain ")

    # its own README, tests and CI; none of the template's suite, tools or maintainer docs
    readme = (project / "README.md").read_text()
    assert readme.startswith("# Deep Sea\n") and len(readme.splitlines()) <= 150
    assert "src/deep_sea/" in readme and "sbatch" in readme and "trainer.num_nodes" in readme
    tests = sorted(str(p.relative_to(project / "tests")) for p in (project / "tests").rglob("*.py"))
    assert tests == ["conftest.py", "contract/__init__.py", "contract/test_contract.py", "test_project.py"]
    for template_only in ("scripts/dev", "docs", ".copier", "copier.yml"):
        assert not (project / template_only).exists(), template_only
    assert (project / "scripts" / "gpu_checks.py").is_file()  # what only a GPU node shows, for the user
    assert "slurm-wlm munge\n" in (project / ".ci" / "run").read_text()
    log = _run(["git", "log", "--oneline"], project).stdout.splitlines()
    assert len(log) == 1 and "Start Deep Sea from the template" in log[0]  # a fresh history, one commit
    assert not (project / ".venv").exists() and not (project / "logs").exists()

    env = {**local_env(), "PYTHONPATH": str(project / "src")}
    _run(
        [PYTHON, "src/train.py", "experiment=quickstart", "debug=fdr", f"paths.log_dir={tmp_path / 'logs'}"],
        project,
        env,
    )
    if examples == "false":  # its quick tier: hpctrain as recorded
        quick = _run([PYTHON, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider"], project, env)
        assert " passed" in quick.stdout and "failed" not in quick.stdout
        # the GPU checks, a user's tool: with no GPU here, the environment passes and every other check is
        # a row "not run" saying why, and the exit status says partial (3)
        checks = tmp_path / "gpu_checks"
        ran = subprocess.run(
            [PYTHON, "scripts/gpu_checks.py", "--out", str(checks)],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert ran.returncode == 3, ran.stdout[-3000:] + ran.stderr[-3000:]
        rows = json.loads((checks / "gpu_checks.json").read_text())["checks"]
        assert len(rows) > 1 and {r["status"] for r in rows} == {"passed", "not run"}
        assert all(r["status"] == "passed" or "no GPU here" in r["summary"] for r in rows), rows


def test_copier_update_brings_hpctrains_changes_and_keeps_every_edit_of_the_user(
    template: Path, tmp_path: Path
):
    project = _generate(
        template,
        tmp_path / "mine",
        "-d",
        "project_name=Mine",
        "-d",
        "package_name=mine",
        "-d",
        "examples=false",
    )
    model = project / "src" / "mine" / "models" / "nets.py"
    model.write_text(model.read_text() + "\n# the user's own model change\n")
    option = project / "conf" / "model" / "wide_cnn.yaml"
    option.write_text("defaults:\n  - mnist_cnn\n  - _self_\noptimizer:\n  lr: 0.5\n")
    readme = project / "README.md"
    readme.write_text(readme.read_text().replace("## Start\n", "## Start (our lab's way)\n"))
    # and an edit inside hpctrain, which the project's tests name (copier still merges it below)
    snapshot = project / "src" / "hpctrain" / "runtime" / "snapshot.py"
    snapshot.write_text(snapshot.read_text() + "\n# the user's edit of hpctrain\n")
    sentence = untouched.check(project / "src")
    assert sentence is not None and sentence.startswith(
        "src/hpctrain/runtime/snapshot.py differs from hpctrain"
    )
    assert "subclass" in sentence and "conf/" in sentence
    _run([*GIT, "add", "-A"], project)
    _run([*GIT, "commit", "-qm", "my changes"], project)

    fixed = template / "src" / "hpctrain" / "runtime" / "environment" / "launched.py"
    fixed.write_text(fixed.read_text() + "\n# a fix in hpctrain\n")
    stopping = template / "src" / "hpctrain" / "conf" / "callbacks" / "early_stopping.yaml"
    stopping.write_text(stopping.read_text().replace("  patience: 5\n", "  patience: 7\n"))
    _run([*GIT, "commit", "-qam", "B"], template)

    _run([COPIER, "update", "--trust", "--defaults", "--quiet", "--vcs-ref=HEAD"], project)
    changed = sorted(line[3:] for line in _run(["git", "status", "--porcelain"], project).stdout.splitlines())
    assert changed == [
        ".copier-answers.yml",
        "src/hpctrain/conf/callbacks/early_stopping.yaml",
        "src/hpctrain/files.sha256",
        "src/hpctrain/runtime/environment/launched.py",
    ]
    assert (
        (project / "src/hpctrain/runtime/environment/launched.py")
        .read_text()
        .endswith("# a fix in hpctrain\n")
    )
    assert "  patience: 7\n" in (project / "src/hpctrain/conf/callbacks/early_stopping.yaml").read_text()
    assert model.read_text().endswith("# the user's own model change\n") and option.is_file()
    assert "## Start (our lab's way)\n" in readme.read_text()
    assert not list(project.rglob("*.rej")) and "<<<<<<<" not in snapshot.read_text()
    assert snapshot.read_text().endswith("# the user's edit of hpctrain\n")  # merged, not lost
    # the record is hpctrain's new version: the only file that differs from it is the user's edit
    assert untouched.differences(project / "src")[1] == ["src/hpctrain/runtime/snapshot.py"]
