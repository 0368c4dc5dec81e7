"""`--help`, `--hydra-help` and `--cfg job` answered again without Hydra when nothing they depend on changed.

These answers are what a user asks many times a day, and Hydra composes the config for each: importing
Hydra and composing this conf/ costs twice `import hydra`, more with every group added. Each answer is a
function of inputs that can all be read in a few milliseconds, so the first answer is stored under a key
made of all of them, and the next identical question is answered from it (about `import hydra`'s time
less than Hydra's, the entry point's own imports included):
- the entry point and its command line (argv), the working directory, the whole environment, the Python
  executable;
- the bytes of every file under conf/ and hpctrain's conf/, and of every `.py` under src/ (the entry points, and the packages
  whose structured configs and resolvers Hydra reads);
- the distributions installed where Python looks (`*.dist-info` names carry the versions of Hydra,
  OmegaConf and every Hydra plugin that adds configs).
Anything outside those would make a stored answer wrong, so such questions are never stored: a config
directory or search path given on the command line (`-cd`, `-cp`, `hydra.searchpath=`), or named in
conf/ (`searchpath`), `--resolve` (resolvers read the clock and the environment at call time), and every
other flag. Answers live in `$XDG_CACHE_HOME/hpctrain/answers` (`~/.cache/...`), the newest 64 kept;
`HPCTRAIN_ANSWER_CACHE=0` turns this off. A failed or unwritable store is silently skipped: the answer was
already printed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpctrain.runtime.config.compose import CODE_ROOT, CONF_DIR, HPCTRAIN_CONF_DIR

KEEP = 64
_ANSWERED = {("--help",), ("-h",), ("--hydra-help",), ("--cfg", "job"), ("-c", "job")}
_UNCACHEABLE_OVERRIDE = "searchpath"


def replay() -> str | None:
    """If this process asks a question answered before with the same inputs, print that answer and exit 0.
    Otherwise the question's key, when it is one worth storing (for `remembering`), else None: held by the
    wrapper that stores the answer, not by this module, so nothing here outlives the command line."""
    key = _question_key(sys.argv[1:])
    if key is None:
        return None
    try:
        text = (_directory() / key).read_text()
    except OSError:
        return key
    sys.stdout.write(text)
    sys.stdout.flush()
    sys.exit(0)


def remembering(print_answer: Callable[..., Any], key: str | None) -> Callable[..., Any]:
    """`print_answer` (Hydra's `app_help`, `hydra_help` or `show_cfg`), its output stored under `key` (the
    question `replay` did not find) when it succeeds; with `key=None`, `print_answer` itself."""
    if key is None:
        return print_answer

    def answer(*args: Any, **kwargs: Any) -> Any:
        buffer = io.StringIO()
        try:
            with contextlib.redirect_stdout(buffer):
                result = print_answer(*args, **kwargs)
        finally:
            sys.stdout.write(buffer.getvalue())  # printed in any case, as Hydra would have
        _store(key, buffer.getvalue())
        return result

    return answer


def _question_key(argv: list[str]) -> str | None:
    if os.environ.get("HPCTRAIN_ANSWER_CACHE") == "0":
        return None
    flags = tuple(a for a in argv if a.startswith("-") or a == "job")
    overrides = [a for a in argv if not a.startswith("-") and a != "job"]
    if flags not in _ANSWERED or any(_UNCACHEABLE_OVERRIDE in o for o in overrides):
        return None
    digest = hashlib.blake2b(digest_size=20)
    script = os.path.abspath(sys.argv[0])  # which entry point asks: each answers its own --help
    for part in (
        script,
        repr(argv),
        os.getcwd(),
        sys.executable,
        sys.version,
        repr(sorted(os.environ.items())),
    ):
        digest.update(part.encode() + b"\0")
    sources = [(CONF_DIR, "*"), (HPCTRAIN_CONF_DIR, "*"), (CODE_ROOT / "src", "*.py")]
    if not HPCTRAIN_CONF_DIR.is_relative_to(CODE_ROOT / "src"):  # hpctrain installed, not in the project
        sources.append((HPCTRAIN_CONF_DIR.parent, "*.py"))
    for root, pattern in sources:
        for path in sorted(p for p in root.rglob(pattern) if p.is_file()):
            content = path.read_bytes()
            if root == CONF_DIR and _UNCACHEABLE_OVERRIDE.encode() in content:
                return None  # a search path in conf/ may name configs outside it
            digest.update(str(path).encode() + b"\0" + content + b"\0")
    for entry in sys.path:
        with contextlib.suppress(OSError):
            installed = sorted(n for n in os.listdir(entry or ".") if n.endswith((".dist-info", ".egg-info")))
            digest.update(f"{entry}:{installed}".encode())
    return digest.hexdigest()


def _directory() -> Path:
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache_home) / "hpctrain" / "answers"


def _store(key: str, text: str) -> None:
    directory = _directory()
    with contextlib.suppress(OSError):
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f".{key}.{os.getpid()}"
        partial.write_text(text)
        os.replace(partial, directory / key)  # whole or absent, whatever runs beside it
        stored = sorted(directory.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in stored[KEEP:]:
            old.unlink(missing_ok=True)
