"""The documentation, tested: the reference pages are what the code says, every command the pages show
composes as the entry point would compose it (and the getting-started ones train), every config key and
group option a page names exists, and the site builds with `mkdocs build --strict`."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hpctrain.runtime.config.compose import compose, config_groups, group_options
from tests.helpers import PYTHON, ROOT, assert_ok, require_modules, train

DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
ENTRY = re.compile(r"(?:^|/)src/(train|eval|predict|export)\.py$")
FLAGS_WITH_A_VALUE = {"--cfg", "-c", "--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd"}
HARDWARE = ("trainer=gpu", "trainer=ddp", "trainer=fsdp", "trainer=mps", "trainer.accelerator=gpu")


def _page(path: Path) -> str:
    return str(path.relative_to(ROOT))


def shell_lines(text: str) -> list[str]:
    """The lines of the page's bash blocks, continuation lines joined."""
    lines = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.DOTALL):
        lines += block.replace("\\\n", " ").splitlines()
    return lines


def commands(text: str) -> list[tuple[str, list[str]]]:
    """(entry point, its overrides) of every command in the page that runs one: `python src/train.py ...`,
    `sbatch ... slurm/train.sbatch ...`, `python scripts/submit.py ... -- ...`."""
    found = []
    for line in shell_lines(text):
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        entry, args = None, []
        for i, token in enumerate(tokens):
            match = ENTRY.search(token)
            if match:
                entry, args = match.group(1), tokens[i + 1 :]
                break
            if token.endswith("slurm/train.sbatch"):
                script = next((t for t in tokens if t.startswith("ENTRY=")), "ENTRY=src/train.py")
                match = ENTRY.search(script.split("=", 1)[1])
                entry, args = (match.group(1) if match else "train"), tokens[i + 1 :]
                break
            if token.endswith("scripts/submit.py") and "--" in tokens:
                entry, args = "train", tokens[tokens.index("--") + 1 :]
                break
        if entry:
            found.append((entry, args))
    return found


def _placeholder(text: str) -> bool:
    """<file>, ..., or a|b|c: the page shows the form, not a value."""
    return "<" in text or "..." in text or "|" in text


def overrides(args: list[str]) -> list[str] | None:
    """The config overrides among a command's arguments (a sweep's first value), or None for a command
    that only asks (--help); placeholders (<...>) and Hydra's own keys are left out."""
    if any(a in ("--help", "-h", "--hydra-help", "--info") for a in args):
        return None
    chosen, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in FLAGS_WITH_A_VALUE:
            skip = True
            continue
        if arg.startswith(("-", "[", "hydra.")) or "=" not in arg or _placeholder(arg):
            continue
        key, value = arg.split("=", 1)
        if "," in value and not value.startswith(("[", "'", '"')) and not key.startswith("hparams_search"):
            value = value.split(",", 1)[0]  # a sweep: its first point
        chosen.append(f"{key}={value}")
    return chosen


def written_by_the_page(text: str) -> set[str]:
    """`group=option` for each config file the page asks the reader to write (conf/model/mymodel.yaml):
    its commands use options that exist only once the reader has written them."""
    return {f"{g}={o}" for g, o in re.findall(r"conf/([a-z_]+(?:/[a-z_]+)?)/([a-z_]+)\.yaml", text)}


def documented_commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for path in PAGES:
        text = path.read_text()
        theirs = written_by_the_page(text)
        for entry, args in commands(text):
            chosen = overrides(args)
            if chosen is not None and not theirs & set(chosen):
                found.append((_page(path), entry, chosen))
    return found


def test_the_reference_pages_are_what_the_code_says():
    result = subprocess.run(
        [PYTHON, "scripts/dev/docs_reference.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_the_pages_show_commands_and_this_test_finds_them():
    found = documented_commands()
    assert len(found) > 40
    assert {entry for _, entry, _ in found} == {"train", "eval", "predict", "export"}
    assert commands("```bash\nsbatch --nodes=2 slurm/train.sbatch trainer=ddp \\\n  model=mlp\n```") == [
        ("train", ["trainer=ddp", "model=mlp"])
    ]


@pytest.mark.slow
def test_every_command_in_the_docs_composes():
    failures = []
    for page, entry, chosen in documented_commands():
        needed = (
            ["ckpt_path=CHECKPOINT"]
            if entry != "train" and not any(o.startswith("ckpt_path=") for o in chosen)
            else []
        )
        try:
            compose(entry, [*chosen, *needed])
        except Exception as err:
            failures.append(f"{page}: python src/{entry}.py {' '.join(chosen)}: {str(err).splitlines()[0]}")
    assert not failures, "\n".join(failures)


def _paths(node: object, prefix: str = "") -> set[str]:
    found = set()
    if isinstance(node, dict):
        for key, value in node.items():
            found.add(f"{prefix}{key}")
            found |= _paths(value, f"{prefix}{key}.")
    return found


@functools.cache
def known_keys() -> frozenset[str]:
    """Every key of every entry's config, with any one option of any group chosen."""
    found: set[str] = set()
    configs = [
        compose(entry, ["ckpt_path=X"] if entry != "train" else []) for entry in ("eval", "predict", "export")
    ]
    for group in config_groups():
        if group.split("/")[0] in ("hydra", "local"):
            continue
        configs += [compose("train", [f"{group}={option}"]) for option in group_options(group)]
    for cfg in configs:
        found |= _paths(OmegaConf.to_container(cfg, resolve=False))
    return frozenset(found)


INLINE = re.compile(r"`([+~]?[a-z_][\w/]*(?:\.[\w/]+)*)=([^`\s]*)`")


def named_settings(text: str) -> list[tuple[str, str]]:
    """The `key=value` and `group=option` a page names: in inline code, and in its commands."""
    named = INLINE.findall(text)
    for line in shell_lines(text):
        named += [tuple(t.split("=", 1)) for t in line.split() if re.match(r"^[+~]?[a-z_][\w./]*=", t)]
    return named


@pytest.mark.slow
def test_every_config_key_and_option_the_pages_name_exists():
    groups = {g for g in config_groups() if g.split("/")[0] != "local"}
    keys = known_keys()
    failures = []
    for path in PAGES:
        text = path.read_text()
        theirs = written_by_the_page(text)
        for key, value in named_settings(text):
            if f"{key}={value}" in theirs:
                continue
            if (
                key.startswith(("+", "hydra", "local"))
                or _placeholder(value)
                or key.split(".")[0] not in keys | groups
            ):
                continue  # a new key (+), Hydra's own, a placeholder, or not a config key (a shell variable)
            key = key.lstrip("~")
            if key in groups:
                options = [v.strip() for v in value.strip("[]").split(",") if v.strip() not in ("", "null")]
                unknown = [o for o in options if o not in group_options(key) and f"{key}={o}" not in theirs]
                if unknown:
                    failures.append(f"{_page(path)}: {key}={value}: {key}/ has no option {unknown[0]}")
            elif key not in keys:
                failures.append(f"{_page(path)}: {key}={value}: no such config key")
    assert not failures, "\n".join(sorted(set(failures)))


def _runnable(page: str, chosen: list[str]) -> bool:
    """A getting-started command that runs here: no GPU, one node, no checkpoint of an earlier run."""
    return page.startswith(("docs/getting-started", "README")) and not any(
        o.startswith((*HARDWARE, "trainer.num_nodes=", "ckpt_path=", "init_from.path=")) for o in chosen
    )


@pytest.mark.slow
def test_the_getting_started_training_commands_train(tmp_path: Path, data_dir: Path):
    """Each train command of the README and the getting-started pages, run for one batch (debug=fdr)."""
    runs = sorted(
        {tuple(c) for page, entry, c in documented_commands() if entry == "train" and _runnable(page, c)}
    )
    assert runs
    for i, chosen in enumerate(runs):
        result = train(tmp_path / str(i), *chosen, "debug=fdr", f"paths.data_dir={data_dir}")  # MNIST offline
        assert_ok(result)
        assert list((tmp_path / str(i)).rglob("run.yaml")), chosen  # a run dir (debug=fdr: under debug/)


@pytest.mark.slow
def test_the_site_builds_with_every_link_whole(tmp_path: Path):
    require_modules("mkdocs", "material", install="pip install -e '.[docs]'")
    result = subprocess.run(
        [PYTHON, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
