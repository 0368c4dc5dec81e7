"""Turn a copy of the template into a project of its own (copier runs this in the new project).

    python .copier/make_project.py --package my_project --project-name "My Project" [--examples=false] [--operation=copy]

The rename is exact rather than a text substitution: the package name is replaced where it stands as a
name of its own (the package directory, imports, `_target_`s, pyproject, the SLURM job names, prose),
never inside a longer word (`hpctrainer` stays). It is idempotent, so `copier update`, which renders
the template again over the project and runs this again, finds nothing left to rename. This file and
examples.txt stay in the template (copier.yml excludes .copier/).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache"}
SKIP_TOP = {"logs", "data", "outputs", "multirun"}  # a run's outputs and datasets, at the project's root


def token(name: str) -> re.Pattern[str]:
    """`name` standing alone: not preceded or followed by a letter or digit (underscores and dots are fine)."""
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(name)}(?![A-Za-z0-9])")


def replacements(old: str, new: str) -> list[tuple[re.Pattern[str], str]]:
    return [(token(old), new), (token(old.upper()), new.upper()), (token(old.title()), new.title())]


def files(root: Path) -> list[Path]:
    found = []
    for path in root.rglob("*"):
        parts = path.relative_to(root).parts
        if parts[0] in SKIP_TOP or any(part in SKIP_DIRS for part in parts):
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


def drop_examples(root: Path, old: str) -> None:
    for line in (HERE / "examples.txt").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        for candidate in {root / line, root / token(old).sub("*", line)}:
            for path in root.glob(str(candidate.relative_to(root))):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    for config in (root / "conf" / "train.yaml", root / "conf" / "eval.yaml"):
        config.write_text(
            re.sub(r"^(\s*- data:) mnist$", r"\1 digits", config.read_text(), flags=re.MULTILINE)
        )
    readme = root / "README.md"
    if readme.is_file():  # sections about the examples: <!-- examples --> ... <!-- /examples -->
        text = re.sub(r"<!-- examples -->.*?<!-- /examples -->\n?", "", readme.read_text(), flags=re.DOTALL)
        readme.write_text(text)


def set_metadata(root: Path, project_name: str, author: str, description: str) -> None:
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
    readme = root / "README.md"
    if readme.is_file():
        lines = readme.read_text().splitlines(keepends=True)
        if lines and lines[0].startswith("# "):
            lines[0] = f"# {project_name}" + (f" — {description}" if description else "") + "\n"
        readme.write_text("".join(lines))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="old", default="hpctrain", help="the template's package name")
    parser.add_argument("--package", required=True)
    parser.add_argument("--project-name", required=True)
    parser.add_argument("--author", default="")
    parser.add_argument("--description", default="")
    parser.add_argument("--examples", default="true", help="false: keep only what quickstart needs")
    parser.add_argument(
        "--operation", default="copy", help="copier's: copy (a new project: git init) or update"
    )
    args = parser.parse_args(argv)
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", args.package):
        parser.error(
            f"--package={args.package} is not a Python package name (lower case, digits, underscores)"
        )
    root = Path.cwd()
    if args.examples.lower() in ("false", "no", "0"):
        drop_examples(root, args.old)
    if args.package != args.old:
        rules = replacements(args.old, args.package)
        rename_paths(root, rules)
        rewrite_texts(root, rules)
    set_metadata(root, args.project_name, args.author, args.description)
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
