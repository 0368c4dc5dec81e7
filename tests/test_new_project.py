"""A new project from the template (copier copy): renamed throughout, runnable and tested at once, with
or without the examples, and able to take a later template fix without losing the user's changes.
(This file stays in the template: copier.yml excludes it.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import PYTHON, ROOT, local_env

pytestmark = pytest.mark.slow

COPIER = str(Path(PYTHON).with_name("copier"))
GIT = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost"]


def _run(command: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 600):
    result = subprocess.run(
        command, cwd=cwd, env=env or local_env(), capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{command}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This working tree (tracked and untracked, not ignored) as a template git repository."""
    repo = tmp_path_factory.mktemp("template") / "repo"
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
    pattern = re.compile(re.escape(name), re.IGNORECASE)
    found = []
    for path in project.rglob("*"):
        if ".git" in path.relative_to(project).parts:
            continue
        if pattern.search(path.name) or (
            path.is_file() and pattern.search(path.read_bytes().decode(errors="ignore"))
        ):
            found.append(str(path.relative_to(project)))
    return found


@pytest.mark.parametrize("examples", ["true", "false"])
def test_a_generated_project_is_renamed_runs_and_passes_its_tests(
    template: Path, tmp_path: Path, examples: str
):
    project = _generate(
        template,
        tmp_path / "deep-sea",
        "-d",
        "project_name=Deep Sea",
        "-d",
        "package_name=deep_sea",
        "-d",
        "author=Ada",
        "-d",
        f"examples={examples}",
    )
    assert (
        _traces(project, "hpctrain") == []
    )  # not in a file, a path, a _target_, a checkpoint key, a job name
    pyproject = (project / "pyproject.toml").read_text()
    assert 'name = "deep_sea"' in pyproject and 'authors = [{ name = "Ada" }]' in pyproject
    assert (project / "README.md").read_text().startswith("# Deep Sea")
    assert "#SBATCH --job-name=deep_sea\n" in (project / "slurm" / "train.sbatch").read_text()
    assert (
        "_target_: deep_sea.models.classifier.ImageClassifier"
        in (project / "conf/model/mnist_cnn.yaml").read_text()
    )
    assert (project / "src" / "deep_sea" / "examples").is_dir() == (examples == "true")
    log = _run(["git", "log", "--oneline"], project).stdout.splitlines()
    assert len(log) == 1 and "Start Deep Sea from the template" in log[0]  # a fresh history, one commit
    assert not (project / ".venv").exists() and not (project / "logs").exists()

    env = {**local_env(), "PYTHONPATH": str(project / "src")}
    _run(
        [PYTHON, "src/train.py", "experiment=quickstart", "debug=fdr", f"paths.log_dir={tmp_path / 'logs'}"],
        project,
        env,
    )
    # Without the examples, the quick tier runs: what it keeps must not lean on what was dropped. With
    # them it is this suite's own quick tier renamed, so every test module is imported (collected) under
    # the new name, and no name is left behind (above): about 35 s less than running it a second time.
    quick_tier = [PYTHON, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider"]
    if examples == "false":
        quick = _run(quick_tier, project, env)
        assert " passed" in quick.stdout and "failed" not in quick.stdout
    else:
        collected = _run([*quick_tier, "--collect-only"], project, env).stdout
        assert re.search(r"\b\d{3}(/\d+)? tests collected", collected), collected[-2000:]


def test_a_later_template_fix_arrives_without_losing_the_users_changes(template: Path, tmp_path: Path):
    project = _generate(template, tmp_path / "mine", "-d", "project_name=Mine", "-d", "package_name=mine")
    model = project / "src" / "mine" / "models" / "nets.py"
    model.write_text(model.read_text() + "\n# the user's own model change\n")
    _run([*GIT, "commit", "-qam", "my model"], project)

    fixed = template / "slurm" / "site.sh"
    fixed.write_text(fixed.read_text() + "\n# a template fix, in a file the user did not touch\n")
    _run([*GIT, "commit", "-qam", "B"], template)

    _run([COPIER, "update", "--trust", "--defaults", "--quiet", "--vcs-ref=HEAD"], project)
    assert model.read_text().endswith("# the user's own model change\n")
    assert (
        (project / "slurm" / "site.sh")
        .read_text()
        .endswith("# a template fix, in a file the user did not touch\n")
    )
    assert _traces(project, "hpctrain") == [] and not list(project.rglob("*.rej"))
    assert "<<<<<<<" not in model.read_text()
