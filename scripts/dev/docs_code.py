"""Write the code a page shows into the page, from the real file, so that it reads the same on GitHub, in a
terminal and on the site, and cannot drift from the file the tests run:

    python scripts/dev/docs_code.py          # rewrites every marked code block of docs/ and README.md
    python scripts/dev/docs_code.py --check  # exit 1 if one differs from its file (tests/test_docs.py)

A block is marked by the line before its fence, `<!-- code: docs/examples/tutorial/mymodel.py -->`: its
body is that file, whole. The fence keeps its language and title (the file the reader creates, which
the page's prose names as well, since GitHub does not show a title). The site's build writes the blocks
again (scripts/dev/mkdocs_hooks.py), so even an unrefreshed page is built with the current file.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The marker line, then a fenced block: ``` (or longer), its info string, its body, the same fence
MARKED = re.compile(
    r"^(?P<marker><!--\s*code:\s*(?P<source>[^\s>]+)\s*-->\n)"
    r"(?P<fence>`{3,})(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$",
    re.MULTILINE | re.DOTALL,
)


def sources(text: str) -> list[str]:
    """The files the marked blocks of a page show, in order."""
    return [m.group("source") for m in MARKED.finditer(text)]


def _fence_for(code: str) -> str:
    """A fence longer than any run of backticks at the start of a line of the code."""
    longest = max((len(m) for m in re.findall(r"^[ \t]*(`{3,})", code, re.MULTILINE)), default=0)
    return "`" * max(3, longest + 1)


def refreshed(text: str, root: Path = ROOT) -> str:
    """`text` with the body of every marked block replaced by its file's current text."""

    def write(match: re.Match[str]) -> str:
        path = root / match.group("source")
        if not path.is_file():
            raise FileNotFoundError(f"<!-- code: {match.group('source')} --> names no file")
        code = path.read_text()
        code = code if code.endswith("\n") else f"{code}\n"
        fence = _fence_for(code)
        return f"{match.group('marker')}{fence}{match.group('info')}\n{code}{fence}"

    return MARKED.sub(write, text)


def pages(root: Path = ROOT) -> list[Path]:
    return [*sorted((root / "docs").rglob("*.md")), root / "README.md"]


def rendered() -> dict[str, str]:
    found = {}
    for page in pages():
        text = page.read_text()
        if MARKED.search(text):
            found[str(page.relative_to(ROOT))] = refreshed(text)
    return found


def main() -> int:
    sys.path.insert(0, str(Path(__file__).parent))
    from generated import write_or_check

    return write_or_check(ROOT, rendered, __doc__.split("\n\n")[0], "scripts/dev/docs_code.py")


if __name__ == "__main__":
    sys.exit(main())
