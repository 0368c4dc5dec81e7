"""The site's build hooks (mkdocs.yml `hooks:`): what is written into pages as the site is built.

- A code block marked `<!-- code: <file> -->` gets the file's current text (scripts/dev/docs_code.py; the
  committed page holds it too, checked by tests/test_docs.py, so GitHub shows the same code).
- The reference pages read from the project's configs (docs/reference/config.md and groups.md) are
  written from them (scripts/dev/docs_reference.py `BUILT_PAGES`), in place of their committed stand-ins:
  a project's own configs appear in its site, and no committed file goes stale when a user adds one.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import docs_code
import docs_reference


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    name = page.file.src_uri
    if name.startswith("reference/") and name.removeprefix("reference/") in docs_reference.BUILT_PAGES:
        return docs_reference.built(name.removeprefix("reference/"))
    return docs_code.refreshed(markdown)
