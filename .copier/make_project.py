"""Turn a copy of the template into a project of its own (copier runs this in the new project, at copy and
at every update).

    python .copier/make_project.py --package my_project --project-name "My Project" [--examples=false]

- The template's user package (`myproject`) becomes the project's: the package directory, imports,
  `_target_`s, pyproject, the SLURM job names, prose. The name is replaced where it stands as a name of
  its own, never inside a longer word, and never in hpctrain (src/hpctrain, src/hydra_plugins/hpctrain_*),
  which the project carries untouched. It is idempotent: `copier update` renders the template again over
  the project and runs this again, and finds nothing left to rename.
- examples=false removes what quickstart (digits + the classic CNN) does not need (examples.txt).
- The project gets its own README, tests and CI (project/ beside this file), not the template's.
- hpctrain's files are recorded (src/hpctrain/files.sha256), so that the project's tests find an edit.
This file and project/ stay in the template (copier.yml excludes .copier/).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE.parent
TEMPLATE_PACKAGE = "myproject"
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache"}
SKIP_TOP = {"logs", "data", "outputs", "multirun"}  # a run's outputs and datasets, at the project's root
CARRIED = ("src/hpctrain", "src/hydra_plugins")  # hpctrain's: never renamed, never edited here


def token(name: str) -> re.Pattern[str]:
    """`name` standing alone: not preceded or followed by a letter or digit (underscores and dots are fine)."""
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(name)}(?![A-Za-z0-9])")


def replacements(old: str, new: str) -> list[tuple[re.Pattern[str], str]]:
    return [(token(old), new), (token(old.upper()), new.upper()), (token(old.title()), new.title())]


def files(root: Path) -> list[Path]:
    found = []
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        parts = relative.parts
        if parts[0] in SKIP_TOP or any(part in SKIP_DIRS for part in parts):
            continue
        if any(relative.as_posix().startswith(carried) for carried in CARRIED):
            continue
        found.append(path)
    return found


def rename_paths(root: Path, rules: list[tuple[re.Pattern[str], str]]) -> None:
    """Rename every file or directory whose name contains the old name; merge into what already exists."""
    for path in sorted(files(root), key=lambda p: len(p.parts), reverse=True):
        name = path.name
        for pattern, replacement in rules:
            name = pattern.sub(replacement, name)
        if name == path.name or not path.exists():
            continue
        target = path.with_name(name)
        if path.is_dir():
            target.mkdir(exist_ok=True)
            for child in list(path.iterdir()):
                destination = target / child.name
                if destination.is_dir() and child.is_dir():
                    shutil.copytree(child, destination, dirs_exist_ok=True)
                    shutil.rmtree(child)
                else:
                    child.replace(destination)
            path.rmdir()
        else:
            path.replace(target)


def rewrite_texts(root: Path, rules: list[tuple[re.Pattern[str], str]]) -> None:
    for path in files(root):
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary files
        new = text
        for pattern, replacement in rules:
            new = pattern.sub(replacement, new)
        if new != text:
            path.write_text(new)


def drop_examples(root: Path) -> None:
    for line in (HERE / "examples.txt").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        for path in root.glob(line):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    for config in (root / "conf" / "train.yaml", root / "conf" / "eval.yaml"):
        config.write_text(
            re.sub(r"^(\s*- data:) mnist$", r"\1 digits", config.read_text(), flags=re.MULTILINE)
        )


def add_project_files(root: Path, values: dict[str, str]) -> None:
    """The project's README, tests and CI, from project/ (the contract tests from the template's tests/)."""
    readme = (HERE / "project" / "README.md").read_text()
    for key, value in values.items():
        readme = readme.replace("{{" + key + "}}", value)
    (root / "README.md").write_text(readme)
    shutil.copytree(HERE / "project" / "tests", root / "tests", dirs_exist_ok=True)
    shutil.copytree(TEMPLATE / "tests" / "contract", root / "tests" / "contract", dirs_exist_ok=True)
    for cache in (root / "tests").rglob("__pycache__"):
        shutil.rmtree(cache)
    (root / ".ci").mkdir(exist_ok=True)
    shutil.copy2(HERE / "project" / "ci_run", root / ".ci" / "run")


def set_metadata(root: Path, author: str, description: str) -> None:
    pyproject = root / "pyproject.toml"
    text = pyproject.read_text()
    if description:
        text = re.sub(
            r'^description = ".*"$',
            f"description = {description!r}".replace("'", '"'),
            text,
            count=1,
            flags=re.M,
        )
    if author and "authors =" not in text:
        text = re.sub(
            r"^(license = .*)$", rf'\1\nauthors = [{{ name = "{author}" }}]', text, count=1, flags=re.M
        )
    pyproject.write_text(text)


def record_hpctrain(root: Path, source: str) -> None:
    """src/hpctrain/files.sha256: hpctrain as the template has it now (hpctrain.testing.untouched, loaded
    by path: copier's interpreter need not have hpctrain's dependencies)."""
    spec = importlib.util.spec_from_file_location(
        "untouched", TEMPLATE / "src" / "hpctrain" / "testing" / "untouched.py"
    )
    assert spec is not None and spec.loader is not None
    untouched = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(untouched)
    init = (root / "src" / "hpctrain" / "__init__.py").read_text()
    version = re.search(r'^__version__ = "([^"]+)"', init, flags=re.M)
    untouched.write_record(root / "src", version.group(1) if version else "?", source)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", required=True)
    parser.add_argument("--project-name", required=True)
    parser.add_argument("--author", default="")
    parser.add_argument("--description", default="")
    parser.add_argument("--examples", default="true", help="false: keep only what quickstart needs")
    parser.add_argument("--template", default=str(TEMPLATE), help="where the template came from (the README)")
    parser.add_argument("--commit", default="", help="the template's commit (hpctrain's record)")
    parser.add_argument(
        "--operation", default="copy", help="copier's: copy (a new project: git init) or update"
    )
    args = parser.parse_args(argv)
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", args.package):
        parser.error(
            f"--package={args.package} is not a Python package name (lower case, digits, underscores)"
        )
    if args.package == "hpctrain":
        parser.error("--package=hpctrain is the machinery's name; choose another for your own package")
    root = Path.cwd()
    if args.examples.lower() in ("false", "no", "0"):
        drop_examples(root)
    values = {
        "project_name": args.project_name,
        "description": args.description,
        "package": args.package,
        "template": args.template,
    }
    add_project_files(root, values)
    if args.package != TEMPLATE_PACKAGE:
        rules = replacements(TEMPLATE_PACKAGE, args.package)
        rename_paths(root, rules)
        rewrite_texts(root, rules)
    set_metadata(root, args.author, args.description)
    record_hpctrain(root, f"the template at {args.commit[:12]}" if args.commit else "the template")
    if args.operation == "copy" and not (root / ".git").exists():
        subprocess.run(["git", "init", "-q"], check=True)
        subprocess.run(["git", "add", "-A"], check=True)
        subprocess.run(
            [
                "git",
                "-c",
                "user.name=copier",
                "-c",
                "user.email=copier@localhost",
                "commit",
                "-q",
                "-m",
                f"Start {args.project_name} from the template",
            ],
            check=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
