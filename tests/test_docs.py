"""The documentation, tested. What "every command is tested" means (docs/index.md says it to readers):

- every file, config key, group option, `hpctrain` import path, script flag and exit status a page names
  exists and is right (quick tier: read from the files and the code, nothing run);
- every command a page shows composes as its entry point would compose it, and a training command
  whose values are all given passes the checks src/train.py makes before anything runs (slow tier);
  the commands of the getting-started pages and the README also run, for a few steps, in a temporary
  log dir, with the tutorial's own files in place of the reader's;
- a code block that needs what the test machine lacks says so in the page's source, on the line before
  it: `<!-- needs: gpu (the reason) -->` (or `cluster`, `network`, `data`, `suite`); its commands are
  checked and composed but not run, and a command that needs a GPU or a cluster outside such a block
  fails a test;
- the Python and YAML a page shows as a file of the reader's are real files (docs/examples/), written
  into the page below a `<!-- code: <file> -->` line (scripts/dev/docs_code.py; equal to the file, so a
  reader on GitHub or in a terminal sees the code the tests run), named in the prose before the block,
  and imported and run here; a block titled with a file of the template is that file, marked alike;
- the reference pages are what the code says (those read from the project's conf/ are written when the
  site is built, so a user's own configs change nothing committed), no generated table cell is cut off,
  and the site builds with `mkdocs build --strict`.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
import shlex
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from hpctrain.runtime.config.compose import CONF_DIR, compose, config_groups, group_options
from tests.helpers import PYTHON, ROOT, parsed, require_modules, run_dirs, run_entry, run_script

DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
# Pages for the people who use the template and their generated projects (not the maintainers' or the
# generated reference): what they name must exist in a generated project too.
USER_PAGES = [
    p
    for p in PAGES
    if p.parent.name not in ("maintainers", "benchmarks", "reference") and p.name != "README.md"
]


def _reading_order(page: Path) -> int:
    """The README first, then the pages in the order the site's navigation lists them."""
    return (
        -1
        if page.name == "README.md"
        else (ROOT / "mkdocs.yml").read_text().find(str(page.relative_to(DOCS)))
    )


# Pages whose commands run here, for a few steps each (the others' are composed): a newcomer's first hour,
# in the order they read it (the README, the getting-started pages, the cheat sheet)
RUN_PAGES = sorted(
    (p for p in PAGES if p.parent.name == "getting-started" or p.name in ("README.md", "cheatsheet.md")),
    key=_reading_order,
)
ENTRY = re.compile(r"(?:^|/)src/(train|eval|predict|export)\.py$")
FLAGS_WITH_A_VALUE = {"--cfg", "-c", "--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd"}
NEEDS = {
    "gpu": "a CUDA GPU",
    "cluster": "a SLURM cluster of the reader's (its partitions, its nodes)",
    "network": "a download",
    "data": "a dataset of the reader's",
    "suite": "the test suite itself (CI runs it: .ci/run)",
}
# What in a command says it needs one of NEEDS
NEEDS_GPU = re.compile(
    r"\btrainer=(gpu|ddp|fsdp|mps)\b|trainer\.accelerator=gpu|--gres=gpu|--gpus-per-node|--nv\b"
)
NEEDS_CLUSTER = re.compile(
    r"^(sbatch|srun|salloc|squeue|sacct|scancel|scontrol|sinfo|torchrun)\b|scripts/submit\.py|hydra/launcher=slurm"
)
SNIPPET = re.compile(r'^[ \t]*-{2,}8<-{2,}[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)
MARK = re.compile(r"<!--\s*needs:\s*(\w+)\s*\(([^)]+)\)\s*-->")
CODE_MARK = re.compile(r"^<!--\s*code:\s*([^\s>]+)\s*-->$", re.MULTILINE)
TINY = (  # appended to every command that trains: seconds, not minutes
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.num_sanity_val_steps=0",
)


def _page(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---------------------------------------------------------------------------------------- reading pages


@dataclass
class Block:
    lang: str
    title: str | None
    body: str  # as written in the page (a snippet include is one line)
    needs: tuple[str, str] | None  # (what, why) from the <!-- needs: ... --> line before the block
    source: str | None  # the file the block shows, from the <!-- code: ... --> line before it
    before: str  # the page's text between the previous block and this one

    @property
    def snippets(self) -> list[str]:
        return SNIPPET.findall(self.body)


FENCE = re.compile(
    r"^(?P<before>(?:[^\n]*\n)?)(?P<indent>[ \t]*)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)


@functools.cache
def blocks(path: Path) -> tuple[Block, ...]:
    text = path.read_text()
    found, end = [], 0
    for match in FENCE.finditer(text):
        info = match.group("info").strip()
        lang = info.split()[0] if info else ""
        title = re.search(r'title="([^"]+)"', info)
        mark = MARK.search(match.group("before"))
        indent = match.group("indent")
        body = "".join(
            line[len(indent) :] if line.startswith(indent) else line
            for line in match.group("body").splitlines(keepends=True)
        )
        needs = mark and (mark.group(1), mark.group(2))
        code = CODE_MARK.search(match.group("before"))
        before, end = text[end : match.start("indent")], match.end()
        found.append(Block(lang, title and title.group(1), body, needs, code and code.group(1), before))
    return tuple(found)


def prose(path: Path) -> str:
    """The page without its code blocks."""
    return FENCE.sub(lambda m: m.group("before"), path.read_text())


def shell_lines(text: str) -> list[str]:
    """The lines of the page's bash blocks, continuation lines joined."""
    lines = []
    for block in re.findall(r"```(?:bash|sh|shell)[^\n]*\n(.*?)```", text, flags=re.DOTALL):
        lines += block.replace("\\\n", " ").splitlines()
    return lines


def block_commands(block: Block) -> list[str]:
    """The commands of one bash block: continuation lines joined, comments and blank lines dropped."""
    if block.lang not in ("bash", "sh", "shell"):
        return []
    found = []
    for line in block.body.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            found.append(line)
    return found


def inline_code(path: Path) -> list[str]:
    return re.findall(r"(?<!`)`([^`]+)`(?!`)", prose(path).replace("\n", " "))


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
        if (
            "," in value
            and not value.startswith(("[", "{", "'", '"'))
            and not key.startswith("hparams_search")
        ):
            value = value.split(",", 1)[0]  # a sweep: its first point
        chosen.append(f"{key}={value}")
    return chosen


def written_by_the_page(text: str) -> set[str]:
    """`group=option` for each config file the page asks the reader to write (conf/model/mymodel.yaml):
    its commands use options that exist only once the reader has written them."""
    return {f"{g}={o}" for g, o in re.findall(r"conf/([a-z_]+(?:/[a-z_]+)?)/([a-z_]+)\.yaml", text)}


def concrete(args: list[str]) -> bool:
    """A command whose every value is given (no <placeholder>, no `...`) and no search's sweeper fills
    any in: its composed config can be checked as the entry point checks it."""
    return not any(_placeholder(a) for a in args) and not any(a.startswith("hparams_search=") for a in args)


def _each_option(chosen: list[str]) -> set[str]:
    """The overrides, with a list of a group's options (`callbacks=[default,mine]`) as each of them too."""
    found = set(chosen)
    for override in chosen:
        group, _, value = override.partition("=")
        if value.startswith("[") and value.endswith("]"):
            found |= {f"{group}={option.strip()}" for option in value[1:-1].split(",")}
    return found


def documented_commands() -> list[tuple[str, str, list[str], bool]]:
    """(page, entry point, its overrides, whether they are concrete) of every command in the pages."""
    found = []
    for path in PAGES:
        text = path.read_text()
        theirs = written_by_the_page(text)
        for entry, args in commands(text):
            chosen = overrides(args)
            if chosen is not None and not theirs & _each_option(chosen):
                found.append((_page(path), entry, chosen, concrete(args)))
    return found


def readers_files(path: Path) -> dict[str, Path]:
    """The files a page shows as the reader's (a block titled with a path that the template does not
    have, or a file of docs/examples/): {the title: the real file}."""
    found = {}
    for block in blocks(path):
        theirs = (block.source or "").startswith("docs/examples/")
        if block.title and block.source and (theirs or not (ROOT / block.title).exists()):
            found[block.title] = ROOT / block.source
    return found


# ------------------------------------------------------------------------------------- the quick tier


def test_the_reference_pages_are_what_the_code_says(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    """The pages read from hpctrain's own code are committed and up to date (those read from the project's
    configs are written when the site is built: test_the_pages_read_from_the_configs_are_written_as_the_site_builds):
    `python scripts/dev/docs_reference.py --check`, run in this process."""
    monkeypatch.setattr("sys.argv", ["scripts/dev/docs_reference.py", "--check"])
    assert _dev_script("docs_reference").main() == 0, capsys.readouterr().err


@functools.cache
def _dev_script(name: str):
    import sys

    sys.path.insert(0, str(ROOT / "scripts" / "dev"))  # their own imports (generated, docs_code)
    return _import(ROOT / "scripts" / "dev" / f"{name}.py", name)


@functools.cache  # two tests read them: each page composes every entry point's config
def built_reference_pages() -> dict[str, str]:
    """The reference pages the site's build writes from the project's configs, as it writes them."""
    docs_reference = _dev_script("docs_reference")
    return {name: docs_reference.built(name) for name in docs_reference.BUILT_PAGES}


def test_the_pages_read_from_the_configs_are_written_as_the_site_builds():
    """config.md and groups.md come from conf/ when the site is built (no committed copy to go stale when a
    user adds a config): every group option and key is on them, the site's hook puts them in place of
    their committed stand-ins, and each stand-in tells a reader without the site where to look."""
    hooks = _dev_script("mkdocs_hooks")
    built = built_reference_pages()
    assert set(built) == {"config.md", "groups.md"}
    for group in config_groups():
        if group.split("/")[0] != "local":
            for option in group_options(group):
                assert f"`{group}={option}`" in built["groups.md"], (group, option)
    assert "| `trainer.max_epochs` |" in built["config.md"] and "| `monitor.metric` |" in built["config.md"]
    for name, text in built.items():
        stand_in = DOCS / "reference" / name
        words = " ".join(stand_in.read_text().split())
        assert (
            "Generated" not in words
            and "when the site is built" in words
            and "Read without the site" in words
        )
        page = type("Page", (), {"file": type("File", (), {"src_uri": f"reference/{name}"})()})()
        assert hooks.on_page_markdown(stand_in.read_text(), page=page) == text
        assert f"reference/{name}" in (ROOT / "mkdocs.yml").read_text()  # still in the site's navigation


def test_the_pages_show_commands_and_this_test_finds_them():
    found = documented_commands()
    assert len(found) > 40
    assert {entry for _, entry, _, _ in found} == {"train", "eval", "predict", "export"}
    assert commands("```bash\nsbatch --nodes=2 slurm/train.sbatch trainer=ddp \\\n  model=mlp\n```") == [
        ("train", ["trainer=ddp", "model=mlp"])
    ]
    (block,) = blocks(DOCS / "getting-started" / "tutorial.md")[:1]
    assert block.lang == "bash" and block_commands(block)[0] == "python src/train.py experiment=quickstart"


def test_no_generated_table_cell_is_cut_off():
    """A description in the generated tables is whole sentences: it ends as a sentence ends."""
    failures = []
    pages = {"public-api.md": (DOCS / "reference" / "public-api.md").read_text()}
    pages["groups.md"] = built_reference_pages()["groups.md"]
    for name, text in pages.items():
        for line in text.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if not line.startswith("| `") or not cells[-1]:
                continue
            if not re.search(r"[.!?)`\"']$", cells[-1]) or re.search(r"[,:;]$", cells[-1]):
                failures.append(f"docs/reference/{name}: {cells[0]}: {cells[-1][-60:]!r}")
    assert not failures, "cut off:\n" + "\n".join(failures)


def test_python_and_the_readers_files_on_the_pages_are_real_files_written_into_the_page():
    """Every Python block is a real file, written into the page whole (below `<!-- code: <file> -->`), so
    GitHub and a terminal show the code the tests run; a block titled with a file of the template is that
    file; every file a block or snippet names exists."""
    failures = []
    for path in PAGES:
        for block in blocks(path):
            for name in [*block.snippets, *([block.source] if block.source else [])]:
                if not (ROOT / name).is_file():
                    failures.append(f"{_page(path)}: {name} does not exist")
            if block.snippets and block.snippets[0].startswith("docs/examples/"):
                failures.append(f"{_page(path)}: {block.snippets[0]} is included, not written into the page")
            if block.lang == "python" and not block.source:
                failures.append(f"{_page(path)}: a python block that is not a file: {block.body[:60]!r}")
            theirs = (block.source or "").startswith(
                "docs/examples/"
            )  # a reader's, even where a user has one
            if block.title and (ROOT / block.title).is_file() and block.source != block.title and not theirs:
                failures.append(f"{_page(path)}: the block titled {block.title} is not that file")
            if (
                block.source
                and (ROOT / block.source).is_file()
                and block.body != (ROOT / block.source).read_text()
            ):
                failures.append(
                    f"{_page(path)}: the block of {block.source} differs from the file; run "
                    "python scripts/dev/docs_code.py"
                )
    assert not failures, "\n".join(failures)


def test_each_file_a_page_shows_is_named_in_the_prose_before_it():
    """A reader on GitHub or in a terminal sees no block title: the text before a file's block names the
    file to create (or the template's file it is)."""
    failures = []
    for path in PAGES:
        for block in blocks(path):
            if block.source and block.title and f"`{block.title}`" not in block.before:
                failures.append(f"{_page(path)}: the text before the block of {block.title} does not name it")
    assert not failures, "\n".join(failures)


def test_the_pages_code_blocks_are_written_from_their_files(tmp_path: Path):
    """scripts/dev/docs_code.py writes a marked block from its file, whole, with a fence its text cannot
    close, and the site's build does the same (scripts/dev/mkdocs_hooks.py)."""
    docs_code = _import(ROOT / "scripts" / "dev" / "docs_code.py", "docs_code")
    page = 'Create `a.py`:\n\n<!-- code: a.py -->\n```python title="a.py"\nold\n```\n\nafter\n'
    with_fence = "x = 1\n```\ninside a docstring\n```\n"
    (tmp_path / "a.py").write_text(with_fence)
    written = docs_code.refreshed(page, tmp_path)
    assert written == (
        'Create `a.py`:\n\n<!-- code: a.py -->\n````python title="a.py"\n' + with_fence + "````\n\nafter\n"
    )
    assert docs_code.refreshed(written, tmp_path) == written  # written once, stable
    assert docs_code.sources(written) == ["a.py"]
    hooks = (ROOT / "mkdocs.yml").read_text()
    assert "scripts/dev/mkdocs_hooks.py" in hooks


# Files a generated project has that the template does not, or has its own of (.copier/make_project.py
# writes them; its README and tests come from .copier/project/)
GENERATED_PROJECT_ONLY = {"src/hpctrain/files.sha256", ".copier-answers.yml", ".ci/run"}
PATH_TOKEN = re.compile(
    r"(?<![\w./-])((?:\./)?(?:src|conf|scripts|slurm|tests|docs|\.ci|\.vscode|\.copier)/[\w./*-]*|"
    r"(?:hpctrain|myproject)/[\w./-]+\.py|Makefile|pyproject\.toml|uv\.lock|mkdocs\.yml|copier\.yml)"
)


def _named_paths(path: Path) -> set[str]:
    """The repository paths a page names: in inline code and in its code blocks (not in Python, whose
    dotted names are imports, nor in the files it includes)."""
    texts = inline_code(path) + [b.body for b in blocks(path) if b.lang != "python" and not b.source]
    found = set()
    for text in texts:
        for token in PATH_TOKEN.findall(text):
            token = token.rstrip(".,;:")
            if not re.search(r"[<>{}$%|]|\.\.\.", token) and token not in ("src/", "conf/"):
                found.add(token.removeprefix("./"))
    return found


def _exists(name: str) -> bool:
    if name.startswith(("hpctrain/", "myproject/")):
        name = f"src/{name}"
    if "*" in name:
        return any(ROOT.glob(name.rstrip("/")))
    if re.fullmatch(r"conf/[\w/]+/", name) and name[5:-1] in config_groups():
        return True  # the reader's own folder of a group's options (conf/cluster/ beside hpctrain's presets)
    return (
        (ROOT / name).exists()
        or (ROOT / ".copier" / "project" / name).exists()  # a generated project's own README, tests, CI
        or name in GENERATED_PROJECT_ONLY
    )


def _ignored_by_git(names: list[str]) -> set[str]:
    """Paths git ignores: the reader's own, machine-local files (conf/local/default.yaml)."""
    result = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        cwd=ROOT,
        input="\n".join(names),
        capture_output=True,
        text=True,
    )
    return set(result.stdout.split())


@functools.cache
def _source_text() -> str:
    """Everything the code could write a file under: the names of run outputs are literals in it (a log
    file is named after its task: `${task_name}.log`)."""
    files = [
        *(ROOT / "src").rglob("*.py"),
        *(ROOT / "src").rglob("*.yaml"),
        *(ROOT / "scripts").rglob("*.py"),
        *(ROOT / "slurm").iterdir(),
    ]
    return "\n".join(p.read_text() for p in files if p.is_file())


def _written_by_the_code(name: str) -> bool:
    return (
        name in _source_text()
        or re.sub(r"^(train|eval|predict|export)\.", "${task_name}.", name) in _source_text()
    )


OUTPUT_NAME = re.compile(r"^[\w-]+\.(?:png|csv|log|ckpt|json|db|pt2|onnx|safetensors)$")


def test_every_file_a_page_names_exists():
    """Files and folders of the project, and the files a run writes (metrics.csv, curves.png): each exists
    in the template or a generated project, or is a file the page shows the reader writing (a titled
    block), or is the reader's own machine-local file (git-ignored); the name of a run's output file is
    one the code writes."""
    failures = []
    for path in PAGES:
        theirs = {b.title for b in blocks(path) if b.title}
        missing = sorted(n for n in _named_paths(path) - theirs if not _exists(n))
        ignored = _ignored_by_git(missing) if missing else set()
        failures += [f"{_page(path)}: {n} does not exist" for n in missing if n not in ignored]
        for code in inline_code(path):
            if OUTPUT_NAME.match(code) and not _written_by_the_code(code) and not _exists(code):
                failures.append(f"{_page(path)}: {code}: no code writes a file of that name")
    assert not failures, "\n".join(failures)


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT / "src" / Path(*parts)
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return base if base.is_dir() else None  # a folder without __init__.py: hpctrain.conf


def _defines(module: Path, name: str) -> bool:
    if module.is_dir():
        return (module / name).exists() or (module / f"{name}.yaml").exists()
    text = module.read_text()
    if re.search(rf"['\"]{re.escape(name)}['\"]\s*:", text):  # a lazily imported public name (_PUBLIC)
        return True
    for node in parsed(text).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
            return True
        targets = [getattr(node, "target", None), *getattr(node, "targets", [])]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
        if isinstance(node, ast.ImportFrom | ast.Import) and any(
            (a.asname or a.name.split(".")[-1]) == name for a in node.names
        ):
            return True
    return False


def resolves(dotted: str) -> bool:
    """`hpctrain.a.b` names a module of hpctrain or a name one of them defines (read, not imported)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = _module_file(parts[:i])
        if module is not None:
            return i == len(parts) or _defines(module, parts[i])
    return False


PUBLIC = {"hpctrain", "hpctrain.load", "hpctrain.UserError", "hpctrain.__version__", "hpctrain.data"}


def _public_data_names() -> set[str]:
    tree = parsed((ROOT / "src" / "hpctrain" / "data" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign) and "_PUBLIC" in ast.unparse(node).split("=")[0]:
            return {f"hpctrain.data.{k.value}" for k in node.value.keys}  # type: ignore[union-attr]
    raise AssertionError("hpctrain.data has no _PUBLIC")


def test_every_hpctrain_name_a_page_names_exists_and_the_guides_use_the_public_api():
    public = PUBLIC | _public_data_names()
    failures = []
    for path in PAGES:
        text = path.read_text()
        # the modules the page has the reader write (a block titled src/hpctrain/.../x.py)
        written = tuple(
            t.removeprefix("src/").removesuffix(".py").replace("/", ".")
            for t in readers_files(path)
            if t.startswith("src/hpctrain/") and t.endswith(".py")
        )
        for dotted in sorted(set(re.findall(r"(?<![\w/.])hpctrain(?:\.[A-Za-z_]\w*)+", text))):
            if dotted.startswith(written) and written:
                continue
            if not resolves(dotted):
                failures.append(f"{_page(path)}: {dotted} does not exist")
            elif path in USER_PAGES and dotted.startswith("hpctrain.data.") and dotted not in public:
                failures.append(
                    f"{_page(path)}: {dotted} is not hpctrain's public API (hpctrain.data.<name>)"
                )
        for module in re.findall(r"^\s*(?:from|import) (hpctrain[\w.]*)", text, flags=re.MULTILINE):
            if path in USER_PAGES and module not in public:
                failures.append(f"{_page(path)}: imports {module}, not hpctrain's public API")
    assert not failures, "\n".join(failures)


@functools.cache
def _flags_of(script: Path) -> frozenset[str]:
    """The flags a script (or the hpctrain module whose main it runs) defines: its '--x' string literals."""
    sources = [script]
    tree = parsed(script.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hpctrain"):
            module = _module_file(node.module.split("."))  # type: ignore[union-attr]
            if module and module.is_file() and any(a.name == "main" for a in node.names):
                sources.append(module)
    flags = set()
    for source in sources:
        for node in ast.walk(parsed(source.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("-"):
                flags.add(node.value.split("=")[0])
    return frozenset(flags)


def _flag_uses(path: Path) -> list[tuple[str, str]]:
    """(script, flag) for each flag a page passes to a script of the template: in its commands, and in
    inline code such as `scripts/submit.py --sweep`. Flags after `--` are Hydra's or the trainer's."""
    texts = [c for b in blocks(path) for c in block_commands(b)] + inline_code(path)
    uses = []
    for text in texts:
        try:
            tokens = shlex.split(text, comments=True)
        except ValueError:
            continue
        script = None
        for token in tokens:
            if token == "--":
                script = None
            elif re.fullmatch(r"(?:\./)?scripts/[\w/]+\.py", token):
                script = token.removeprefix("./")
            elif token in ("tests/contract", "pytest") or token.startswith("hpctrain.testing.local_slurm"):
                script = (
                    "src/hpctrain/testing/plugin.py" if "contract" in token or token == "pytest" else None
                )
            elif script and re.match(r"--?[A-Za-z]", token):
                uses.append((script, token.split("=")[0]))
    return uses


PYTEST_FLAGS = {"-q", "-m", "-k", "-x", "-p", "-n", "-v", "--dist", "--durations"}


def test_every_script_flag_a_page_names_exists():
    failures = []
    for path in PAGES:
        for script, flag in _flag_uses(path):
            if not (ROOT / script).is_file():
                failures.append(f"{_page(path)}: {script} does not exist")
            elif flag not in _flags_of(ROOT / script) and not (
                script.endswith("plugin.py") and flag in PYTEST_FLAGS
            ):
                failures.append(f"{_page(path)}: {script} has no flag {flag}")
    assert not failures, "\n".join(sorted(set(failures)))


def _exit_statuses(script: Path) -> set[int]:
    """The statuses a script can end with: the integers it returns from main or passes to sys.exit, 2 for
    argparse's usage errors, 0."""
    tree = parsed(script.read_text())
    found = {0}
    for node in ast.walk(tree):
        value = None
        if isinstance(node, ast.Return):
            value = node.value
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.exit", "exit", "SystemExit"):
            value = node.args[0] if node.args else None
        if isinstance(value, ast.Constant) and isinstance(value.value, int):
            found.add(value.value)
    if "argparse" in script.read_text():
        found.add(2)
    return found


def test_a_scripts_one_sentence_error_exits_2_and_the_exit_statuses_the_pages_name_are_real():
    """`error: <sentence>` ends with exit status 2 (docs/reference/errors.md), from the entry points and
    from every script alike; an exit status a page gives a script is one the script can end with."""
    failures = []
    for script in sorted((ROOT / "scripts").glob("*.py")):
        for node in ast.walk(parsed(script.read_text())):
            if isinstance(node, ast.ExceptHandler) and "UserError" in ast.unparse(node.type or ast.Pass()):
                for inner in ast.walk(node):
                    code = None
                    if isinstance(inner, ast.Return) and isinstance(inner.value, ast.Constant):
                        code = inner.value.value
                    if code not in (None, 2):
                        failures.append(
                            f"scripts/{script.name}: a UserError ends with exit status {code}, not 2"
                        )
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) == "sys.exit"
                and node.args
                and isinstance(node.args[0], ast.JoinedStr | ast.Constant)
                and ast.unparse(node.args[0]).lstrip("f'\"").startswith("error:")
            ):
                failures.append(
                    f"scripts/{script.name}: sys.exit('error: ...') ends with exit status 1, not 2"
                )
    claim = re.compile(r"(scripts/\w+\.py)[^.]*?\bexits?(?: with)?(?: status)? (\d+)")
    for path in PAGES:
        for script, status in claim.findall(" ".join(prose(path).split())):
            if int(status) not in _exit_statuses(ROOT / script):
                failures.append(f"{_page(path)}: {script} never exits with status {status}")
    assert not failures, "\n".join(failures)


def test_the_supported_versions_and_extras_the_pages_name_are_pyprojects():
    pyproject = (ROOT / "pyproject.toml").read_text()  # read as text: tomllib is Python 3.11+
    dependencies = pyproject.split("dependencies = [", 1)[1].split("]", 1)[0]
    ranges = {m[0]: (m[1], m[2]) for m in re.findall(r'"([\w-]+)>=([\d.]+),<([\d.]+)"', dependencies)}
    optional = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([\w-]+) = \[", optional, flags=re.MULTILINE))
    failures = []
    table = re.findall(
        r"^\| ([\w-]+) \| ([\d.x]+) \| ([\d.x]+) \|$",
        (DOCS / "getting-started" / "install.md").read_text(),
        re.M,
    )
    assert table
    for name, oldest, newest in table:
        low, high = ranges[name]
        major, minor = high.split(".")[:2]
        last = f"{major}.{int(minor) - 1}"  # <2.16: 2.15 is the newest release allowed
        if not low.startswith(oldest.rstrip(".0")) or not (newest == last or newest.startswith(f"{last}.")):
            failures.append(
                f"install.md: {name} {oldest} to {newest}, but pyproject.toml allows >={low},<{high}"
            )
    for path in PAGES:
        for target, extra in re.findall(r"pip install (?:-e )?'([^'\[]+)\[([\w,-]+)\]'", path.read_text()):
            if target != ".":
                failures.append(
                    f"{_page(path)}: pip install '{target}[...]': install the project, '.[{extra}]'"
                )
            failures += [f"{_page(path)}: no extra {e}" for e in extra.split(",") if e not in extras]
    assert not failures, "\n".join(failures)


def _excluded_from_a_project() -> list[str]:
    copier = yaml.safe_load((ROOT / "copier.yml").read_text())
    return [p.strip("/") for p in copier["_exclude"] if p.startswith("/")]


def test_the_user_pages_name_only_what_a_generated_project_has():
    """A generated project has no template test suite, no scripts/dev/ and no make benchmark: the guides
    send nobody there (the maintainers' pages may)."""
    excluded = [e for e in _excluded_from_a_project() if e not in ("logs", "data", "outputs", "multirun")]
    failures = []
    for path in USER_PAGES:
        for name in _named_paths(path):
            top = name.split("/")[0]
            template_only = top in excluded or name.startswith("scripts/dev")
            if template_only and not _exists_in_a_project(name):
                failures.append(f"{_page(path)}: {name} is not in a generated project")
        for target in re.findall(r"\bmake (benchmark|versions)\b", path.read_text()):
            failures.append(f"{_page(path)}: make {target} is not in a generated project")
    assert not failures, "\n".join(sorted(set(failures)))


def _exists_in_a_project(name: str) -> bool:
    return (
        name.startswith(("tests/contract", "docs/"))  # the contract tests are copied; docs/ is this site
        or (ROOT / ".copier" / "project" / name).exists()
        or name in GENERATED_PROJECT_ONLY
    )


def test_a_batch_job_is_submitted_in_one_form():
    """`sbatch ... slurm/train.sbatch ...` never passes trainer.num_nodes or trainer.devices (the batch file
    passes SLURM's counts), and asks for one task per GPU: the form slurm/train.sbatch itself shows."""
    sources = [*PAGES, ROOT / ".copier" / "project" / "README.md", *(ROOT / "slurm").glob("*.sbatch")]
    failures = []
    for path in sources:
        text = path.read_text()
        lines = shell_lines(text) if path.suffix == ".md" else [c.lstrip("#") for c in text.splitlines()]
        for line in lines:
            tokens = line.split("#")[0].split()
            if "sbatch" not in tokens or not any(t.endswith("slurm/train.sbatch") for t in tokens):
                continue
            flags = dict(t.split("=", 1) for t in tokens if t.startswith("--") and "=" in t)
            gpus = flags.get("--gres", "").removeprefix("gpu:")
            if any(t.startswith(("trainer.num_nodes=", "trainer.devices=")) for t in tokens):
                failures.append(
                    f"{path.relative_to(ROOT)}: {line.strip()[:90]}: the sbatch file passes the counts"
                )
            elif gpus.isdigit() and flags.get("--ntasks-per-node") != gpus:
                failures.append(f"{path.relative_to(ROOT)}: {line.strip()[:90]}: one task per GPU")
    assert not failures, "\n".join(failures)


def _readme_sections() -> set[str]:
    return {h.strip() for h in re.findall(r"^#+ (.+)$", (ROOT / "README.md").read_text(), re.M)}


def test_every_readme_section_named_exists():
    """`README "A section"` in pages, configs and scripts: the README has that section."""
    sources = [
        *PAGES,
        *(ROOT / "conf").rglob("*.yaml"),
        *(ROOT / "scripts").glob("*.py"),
        *(ROOT / "src").rglob("*.py"),
    ]
    failures = []
    for path in sources:
        for section in re.findall(r"README[,:]? \"([^\"]+)\"|README: ([A-Z][\w ]+)", path.read_text()):
            name = section[0] or section[1].strip()
            if name not in _readme_sections():
                failures.append(f"{path.relative_to(ROOT)}: README has no section {name!r}")
    assert not failures, "\n".join(failures)


def _runnable(command: str) -> bool:
    """A command the slow tier runs: an entry point, `make train`, the contract tests, or a script it runs on
    the runs before (SCRIPTS)."""
    words = command.split()
    if any(w.removeprefix("./") in SCRIPTS for w in words[:2]):
        return True
    return bool(
        re.match(
            r"^(?:\S*python\S* )?src/(train|eval|predict|export)\.py\b", command.replace(".venv/bin/", "")
        )
        or command.startswith("make train")
        or (len(words) > 3 and "pytest" in words[0:3] and "tests/contract" in words)
    )


def test_every_command_runs_here_or_says_what_it_needs():
    """A command that needs a GPU or a cluster is in a block marked `<!-- needs: ... (why) -->`; on the
    getting-started pages and in the README every other command is one the slow tier runs."""
    failures = []
    for path in PAGES:
        for block in blocks(path):
            if block.needs:
                what, why = block.needs
                if what not in NEEDS or len(why.split()) < 2:
                    failures.append(
                        f"{_page(path)}: needs: {what} ({why}): one of {sorted(NEEDS)}, with the reason"
                    )
                continue
            for command in block_commands(block):
                if NEEDS_GPU.search(command) or any(
                    NEEDS_CLUSTER.search(part.strip()) for part in command.split("&&")
                ):
                    failures.append(
                        f"{_page(path)}: {command[:90]}: mark its block <!-- needs: gpu|cluster (why) -->"
                    )
                elif path in RUN_PAGES and not _runnable(command):
                    failures.append(
                        f"{_page(path)}: {command[:90]}: not run by tests/test_docs.py; mark its block"
                    )
    assert not failures, "\n".join(failures)


# -------------------------------------------------------------------------------------- the slow tier


@pytest.mark.slow
def test_every_command_in_the_docs_composes_and_passes_the_checks(tmp_path: Path):
    """Each command's config, composed as its entry point composes it, and, where the command gives every
    value, checked as the entry point checks it before anything runs (types, ranges, k-fold, loggers,
    outputs)."""
    from hpctrain.runtime.config.checks import check_config

    failures, seen = [], set()
    outputs = [f"paths.output_dir={tmp_path / 'run'}", f"paths.log_dir={tmp_path}"]
    for page, entry, chosen, given in documented_commands():
        if (entry, *chosen) in seen:
            continue  # composed already, for another page
        seen.add((entry, *chosen))
        needed = (
            ["ckpt_path=CHECKPOINT"]
            if entry != "train" and not any(o.startswith("ckpt_path=") for o in chosen)
            else []
        )
        try:
            cfg = compose(entry, [*chosen, *needed, *outputs])
            if given and entry == "train":
                check_config(cfg)
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


def _option_keys(group: str, path: Path) -> set[str]:
    """The keys one option's file sets, under the package it sets them in (its group's path, or what its
    `# @package` line says): read from the file, not composed."""
    text = path.read_text()
    header = re.search(r"^# @package (\S+)", text, flags=re.MULTILINE)
    package = group.replace("/", ".") if header is None else header.group(1)
    node = yaml.safe_load(text) or {}
    node.pop("defaults", None)
    if package != "_global_":
        for part in reversed(package.split(".")):
            node = {part: node}
    return _paths(node)


@functools.cache
def known_keys() -> frozenset[str]:
    """Every key of every entry's config as composed, every key any option of any group sets, and Hydra's
    own keys with the template's launcher and sweeper."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    found: set[str] = set()
    for entry in ("train", "eval", "predict", "export"):
        cfg = compose(entry, ["ckpt_path=X"] if entry != "train" else [])
        found |= _paths(OmegaConf.to_container(cfg, resolve=False))
    for group in config_groups():
        if group.split("/")[0] != "local":
            for path in group_options(group).values():
                found |= _option_keys(group, path)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        hydra_cfg = hydra_compose(
            "train", ["hydra/launcher=slurm", "hydra/sweeper=optuna"], return_hydra_config=True
        )
    found |= _paths({"hydra": OmegaConf.to_container(hydra_cfg.hydra, resolve=False)})
    return frozenset(found)


INLINE = re.compile(r"`([+~]?[a-z_][\w/]*(?:\.[\w/]+)*)=([^`\s]*)`")
FILE_SUFFIX = re.compile(
    r"\.(?:pt2|onnx|safetensors|ckpt|ya?ml|csv|png|md|py|json|txt|log|db|pth?|npy|npz|sif|out|sh|sbatch)$"
)


def named_settings(text: str) -> list[tuple[str, str]]:
    """The `key=value` and `group=option` a page names: in inline code, and in its commands."""
    named = INLINE.findall(text)
    for line in shell_lines(text):
        named += [tuple(t.split("=", 1)) for t in line.split() if re.match(r"^[+~]?[a-z_][\w./]*=", t)]
    return named


def named_keys(path: Path) -> list[str]:
    """The config keys a page names alone, in inline code: `requeue.signal_lead_s`."""
    return [
        code.lstrip("~")
        for code in inline_code(path)
        if re.fullmatch(r"~?[a-z_]\w*(?:\.[a-z_]\w*)+", code) and not FILE_SUFFIX.search(code)
    ]


@pytest.mark.slow
def test_every_config_key_and_option_the_pages_name_exists():
    groups = {g for g in config_groups() if g.split("/")[0] != "local"}
    keys = known_keys()
    tops = {k.split(".")[0] for k in keys}
    failures = []
    for path in PAGES:
        text = path.read_text()
        theirs = written_by_the_page(text)
        for key, value in named_settings(text):
            if f"{key}={value}" in theirs:
                continue
            if (
                key.startswith(("+", "local"))
                or _placeholder(value)
                or key.split(".")[0] not in tops | groups
            ):
                continue  # a new key (+), a placeholder, or not a config key (a shell variable)
            key = key.lstrip("~")
            if key in groups:
                options = [v.strip() for v in value.strip("[]").split(",") if v.strip() not in ("", "null")]
                unknown = [o for o in options if o not in group_options(key) and f"{key}={o}" not in theirs]
                if unknown:
                    failures.append(f"{_page(path)}: {key}={value}: {key}/ has no option {unknown[0]}")
            elif key not in keys:
                failures.append(f"{_page(path)}: {key}={value}: no such config key")
        for key in named_keys(path):
            first, second = key.split(".")[:2]
            if first == "hydra" and f"hydra.{second}" not in keys:
                continue  # Hydra's Python API (hydra.utils.instantiate), not its config
            if first in tops and key not in keys:
                failures.append(f"{_page(path)}: {key}: no such config key")
    assert not failures, "\n".join(sorted(set(failures)))


def install_readers_files(pages: list[Path], where: Path) -> tuple[str, dict[str, str]]:
    """The reader's files that the pages show (src/myproject/..., conf/...), written under `where` as a
    package of their own (myproject stays the template's): the override that adds their configs, and
    the environment that finds their code."""
    name = f"readers_project_{uuid.uuid4().hex[:8]}"  # a new name each time: imported packages are cached
    package, conf = where / "pkg" / name, where / "conf"
    for page in pages:
        for title, source in readers_files(page).items():
            text = source.read_text().replace("myproject.", f"{name}.")
            if title.startswith("src/myproject/"):
                target = package / title.removeprefix("src/myproject/")
            elif title.startswith("conf/"):
                target = conf / title.removeprefix("conf/")
            else:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
    for folder in [package, *package.rglob("*")]:
        if folder.is_dir():
            (folder / "__init__.py").touch()
    return f"hydra.searchpath=[file://{conf}]", {"PYTHONPATH": str(where / "pkg")}


# Counts a line gives that the transcript makes tiny (its own value replaced): an Optuna study's trials
TINY_VALUES = {"hydra.sweeper.n_trials": "2"}
# What a line costs beyond its claim, made cheap: torch.compile's inductor builds C++ for minutes on a
# CPU; aot_eager runs the same graph capture (tests/test_beyond_mnist.py compiles the same way)
CHEAPER = {"compile=true": ("compile_backend=aot_eager",)}
# Forms the cheat sheet gives, filled in with the tutorial's options
FORMS = {"<your model option>": "mymodel", "<your data option>": "mydata"}
# A line that ends in a one-sentence refusal where an optional package is missing, as the pages say
# (your model: a logger whose package is missing; fine-tune, predict, export: onnx): {part of the line:
# (the package, what the sentence says)}
MAY_REFUSE = {
    "logger=tensorboard": ("tensorboard", "needs the tensorboard package"),
    "mlflow": ("mlflow", "needs the mlflow package"),
    "export.format=onnx": ("onnx", "pip install"),
}
SCRIPTS = ("scripts/plot.py", "scripts/summarize.py")  # scripts the transcript runs on its runs


def _debug_keys(args: list[str]) -> set[str]:
    """The trainer keys a line's debug option sets: its own limits are what the line tries."""
    chosen = next((a.split("=", 1)[1] for a in args if a.startswith("debug=")), None)
    if chosen is None or chosen not in group_options("debug"):
        return set()
    node = yaml.safe_load(group_options("debug")[chosen].read_text()) or {}
    return {f"trainer.{key}" for key in node.get("trainer") or {}}


def as_run(command: str, where: Path | None = None) -> tuple[str, ...]:
    """A page's command as the slow tier runs it: `make train` is the quickstart it runs; a training gets
    tiny limits (one epoch of two batches; two epochs for one that continues a run), except those its
    debug option sets; the forms and the paths outside the run's folder (`/scratch/...`, `photos/`) are
    filled in under `where`; `<run>` stays, for the newest run when it runs."""
    for form, option in FORMS.items():
        command = command.replace(form, option)
    if where is not None:
        command = re.sub(
            r"(?<![^\s=])logs/train/multiruns/<sweep>", str(where / "logs/train/multiruns/sweep"), command
        )
        command = re.sub(r"(?<==)/scratch/", f"{where}/scratch/", command)
        command = re.sub(r"(?<==)photos/", f"{where}/photos/", command)
    tokens = shlex.split(command, comments=True)
    if tokens[:2] == ["make", "train"]:
        tokens = ["python", "src/train.py", "experiment=quickstart"]
    if "pytest" in tokens[:3]:
        return ("pytest", *tokens[tokens.index("tests/contract") :])
    script = next((t for t in tokens if t.removeprefix("./") in SCRIPTS), None)
    if script is not None:
        return ("script", script.removeprefix("./"), *tokens[tokens.index(script) + 1 :])
    at = next(i for i, t in enumerate(tokens) if ENTRY.search(t))
    entry, args = ENTRY.search(tokens[at]).group(1), tokens[at + 1 :]  # type: ignore[union-attr]
    if entry != "train" or any(a.startswith(("--help", "--cfg")) for a in args):
        return (entry, *args)
    resumed = any(a.startswith("ckpt_path=") for a in args)
    kept = _debug_keys(args)
    limits = [
        t.replace("max_epochs=1", "max_epochs=2") if resumed else t
        for t in TINY
        if t.split("=")[0] not in kept
    ]
    args = [
        f"{a.split('=')[0]}={TINY_VALUES[a.split('=')[0]]}" if a.split("=")[0] in TINY_VALUES else a
        for a in args
    ]
    cheaper = [extra for part, extras in CHEAPER.items() if part in args for extra in extras]
    replaced = {t.split("=")[0] for t in limits}
    return (entry, *[a for a in args if a.split("=")[0] not in replaced], *limits, *cheaper)


def run_contract_checks(args: tuple[str, ...], where: Path, searchpath: str, caplog) -> None:
    """`pytest tests/contract --model=M --data=D`, in this process: the checks of one batch, the checkpoint
    round trip and the mid-epoch resume (the DDP check is what the tutorial's next command runs)."""
    from hpctrain.testing import contract as checks

    options = dict(a.removeprefix("--").split("=", 1) for a in args if a.startswith("--"))
    pair = checks.Pair(options["model"], options["data"], (searchpath,))
    checks.test_one_batch_trains_with_finite_gradients(checks.Contract(pair, where / "batch"), pair)
    checks.test_checkpoint_loads_weights_only_and_gives_the_same_outputs(
        checks.Contract(pair, where / "checkpoint"), pair
    )
    checks.test_resumes_mid_epoch_exactly_or_says_it_cannot(
        checks.Contract(pair, where / "resume"), pair, caplog
    )


def newest_run(log_dir: Path) -> Path:
    (last,) = [p for p in run_dirs(log_dir) if (p / "checkpoints" / "last.ckpt").is_file()][-1:]
    return last


def run(command: tuple[str, ...], log_dir: Path, searchpath: str, env: dict[str, str]):
    """One command into `log_dir`, as a newcomer who wrote the tutorial's files into the project runs it
    (their configs found through `searchpath`); `<run>` is the newest run there with a last.ckpt."""
    entry, *args = command
    if any("<run>" in a for a in args):
        args = [re.sub(r"(?<![^\s=])logs/train/runs/<run>", str(newest_run(log_dir)), a) for a in args]
    if entry == "script":
        return run_script(*args, env=env)
    if any(a.startswith(("--help", "--cfg")) for a in args):
        return run_entry(f"{entry}.py", *args, searchpath, env=env)
    flags = [a for a in args if a.startswith("-")]  # -m, which argparse wants before the overrides
    rest = [a for a in args if not a.startswith("-")]  # the line's own first, as a newcomer types them
    where = [] if any(a.startswith("paths.log_dir=") for a in rest) else [f"paths.log_dir={log_dir}"]
    limit = ["trainer.limit_test_batches=1"] if entry != "train" else []
    return run_entry(f"{entry}.py", *flags, *rest, *where, *limit, searchpath, env=env)


def refused_as_documented(command: str, result) -> str | None:
    """Why a line's non-zero exit is what its page says happens here (MAY_REFUSE), or None."""
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    for part, (package, says) in MAY_REFUSE.items():
        missing = part in command and importlib.util.find_spec(package) is None
        if missing and result.returncode == 2 and len(set(errors)) == 1 and says in errors[0]:
            return f"{package} is not installed: {errors[0]}"
    return None


def sample_lines(page: Path, after: str) -> list[re.Pattern[str]]:
    """The lines of the page's first `text` block after `after`, as patterns of what a run prints: any
    number for a number, anything for `<...>` and `...`, any folder before `logs/`."""
    text = page.read_text()
    block = re.search(r"```text\n(.*?)```", text[text.index(after) :], re.DOTALL)
    assert block, f"{_page(page)} shows no sample after {after!r}"
    patterns = []
    for line in block.group(1).splitlines():
        if line.strip() in ("", "..."):
            continue
        pattern = re.escape(line.strip())
        pattern = re.sub(r"<[^>]+>", ".+", pattern)
        pattern = pattern.replace(r"\.\.\.", ".*").replace("logs/", r"\S*logs/")
        pattern = re.sub(r"\d+(\\\.\d+)?", r"\\d+(\\.\\d+)?", pattern)
        patterns.append(re.compile(pattern))
    return patterns


def _photos(folder: Path) -> None:
    """A few digits as PNG files: `predict.input=photos/` of the cheat sheet."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (20 + i, 24), dtype=np.uint8)).save(folder / f"digit{i}.png")


@pytest.mark.slow
def test_the_newcomers_transcript_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog):
    """A newcomer's first hour: each command of the README, the getting-started pages and the cheat sheet
    that is not marked as needing what this machine lacks, run as the page gives it, one after another in
    one log dir (so `ckpt_path=last` and `<run>` find the runs before them), with tiny limits and the
    tutorial's files in place of the reader's (they train for a few steps on scikit-learn's digits, under
    DDP on two processes). Each line exits 0, or, where the page says so, with its one-sentence refusal;
    a command two pages give alike runs once. Then: the README shows what the quickstart printed and the
    files it left; a checkpoint of the tutorial's model, whose config came from a searchpath, is refused by
    eval.py with the searchpath its training recorded, and evaluated when it is passed again."""
    searchpath, env = install_readers_files(RUN_PAGES, tmp_path / "readers")
    monkeypatch.syspath_prepend(env["PYTHONPATH"])
    _photos(tmp_path / "photos")
    logs = tmp_path / "logs"
    done: dict[tuple[str, ...], str] = {}
    failures, refusals = [], []
    for path in RUN_PAGES:
        for block in blocks(path):
            if block.needs:
                continue
            for command in block_commands(block):
                runnable = as_run(command, tmp_path)
                if runnable in done:
                    continue
                assert not any("<" in a and "<run>" not in a for a in runnable), (
                    f"a form to fill in: {command}"
                )
                started = time.monotonic()
                output = ""
                if runnable[0] == "pytest":
                    run_contract_checks(runnable, tmp_path / "contract", searchpath, caplog)
                else:
                    result = run(runnable, logs, searchpath, env)
                    output = result.stdout
                    why = refused_as_documented(command, result)
                    if why:
                        refusals.append(f"{_page(path)}: {command}: {why}")
                    elif result.returncode != 0:
                        failures.append(f"{_page(path)}: {command}\n{result.stdout[-3000:]}")
                done[runnable] = output
                print(f"{time.monotonic() - started:5.1f} s  {_page(path)}: {command}")
    print("\n".join(refusals))
    assert any(r[0] == "pytest" for r in done) and any("ddp_cpu" in " ".join(r) for r in done)

    # the README's first screen: what the quickstart printed, and where its files went
    printed = done[as_run("make train")].splitlines()
    for pattern in sample_lines(ROOT / "README.md", "## The first run"):
        if not any(pattern.search(line) for line in printed):
            failures.append(f"README: the quickstart printed no line like {pattern.pattern}")
    quickstart = [p for p in run_dirs(logs) if "quickstart" in (p / "config.yaml").read_text()]
    listed = (ROOT / "README.md").read_text().split("Everything the run wrote is in its run dir", 1)[1]
    names = re.findall(r"(?:^|(?<=\s\s))(\S+\.\w+|\S+/)(?=\s{2,})", listed.split("```")[1], re.MULTILINE)
    assert len(names) >= 7, names
    failures += [
        f"README: the run dir has no {name}" for name in names if not (quickstart[0] / name).exists()
    ]

    # the tutorial's checkpoint: its classes came from the searchpath, which eval.py names to trust them
    tutorial = [p for p in run_dirs(logs) if "mymodel" in (p / "config.yaml").read_text()][-1]
    evaluate = (f"ckpt_path={tutorial / 'checkpoints' / 'last.ckpt'}", f"paths.log_dir={logs}")
    refused = run_entry("eval.py", *evaluate, env=env)
    errors = [line for line in refused.stdout.splitlines() if line.startswith("error: ")]
    if not (
        refused.returncode == 2
        and len(errors) == 1
        and f"Its training run searched more configs: {searchpath}" in errors[0]
    ):
        failures.append(f"eval.py without the searchpath:\n{refused.stdout[-3000:]}")
    evaluated = run_entry("eval.py", *evaluate, "trainer.limit_test_batches=1", searchpath, env=env)
    if evaluated.returncode != 0:
        failures.append(f"eval.py with the searchpath its training recorded:\n{evaluated.stdout[-3000:]}")

    # fine-tune, predict, export: the notebook lines, on the newest checkpoint of these runs
    import torch

    notebook = _import(DOCS / "examples" / "predict_in_a_notebook.py", "predict_in_a_notebook")
    images = torch.randint(0, 256, (5, 1, 28, 28), dtype=torch.uint8)
    probabilities = notebook.class_probabilities(str(quickstart[-1] / "checkpoints" / "last.ckpt"), images)
    assert probabilities.shape == (5, 10) and torch.allclose(probabilities.sum(1), torch.ones(5))
    assert not failures, "\n\n".join(failures)


def _import(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_code_the_guides_show_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The guides' Python and YAML, the files themselves: your data's k-fold datamodule over a .npz file
    (its config composed and built) and your model's extra callback. (The notebook lines of fine-tune,
    predict, export run at the end of test_the_getting_started_commands_run, on its checkpoint.)"""
    import numpy as np
    import torch

    from hpctrain.runtime.config.targets import instantiate  # the configs' targets allowed (Hydra 1.4)
    from hpctrain.runtime.errors import UserError

    searchpath, env = install_readers_files(PAGES, tmp_path / "readers")
    monkeypatch.syspath_prepend(env["PYTHONPATH"])
    rng = np.random.default_rng(0)
    npz = tmp_path / "data" / "tabular.npz"
    npz.parent.mkdir()
    np.savez(
        npz,
        x=rng.normal(size=(200, 4)),
        y=np.arange(200) % 3,
        x_test=rng.normal(size=(30, 4)),
        y_test=np.arange(30) % 3,
    )

    cfg = compose(
        "train",
        ["data=tabular", f"paths.data_dir={npz.parent}", "data.num_folds=5", "data.fold=1", searchpath],
    )
    tabular = instantiate(cfg.data)
    tabular.setup("fit")
    assert (len(tabular.train_set), len(tabular.val_set), len(tabular.test_set)) == (160, 40, 30)
    x, y = next(iter(tabular.train_dataloader()))
    assert x.shape[1] == 4
    assert y.dtype == torch.int64
    with pytest.raises(UserError, match=r"data\.fold"):
        type(tabular)(str(npz), num_folds=5, fold=7)

    swa = compose("train", ["experiment=quickstart", "callbacks=[default,swa]", searchpath])
    assert type(instantiate(swa.callbacks.swa)).__name__ == "StochasticWeightAveraging"


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
