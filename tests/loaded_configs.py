"""One store of the config files Hydra has read, for each test process.

Hydra reads and parses every config file again for each composition: the repository it reads them
through keeps what it loaded for that one composition only. A test process composes the same few dozen
files a few hundred times (every option of every group, each entry point's config, every refusal), and
reading them is about a third of a composition's 0.1 s of CPU. Here Hydra's `ConfigRepository.load_config`
keeps each file's result, under the file and its size and modification time (a file edited or added is
read again), and gives each composition its own deep copy (Hydra changes what it loads while it composes).
The ConfigStore's configs, and anything that is not a file, are read as Hydra reads them. The compositions
are Hydra's own: tests/test_loaded_configs.py compares them.

Only the test processes use it (tests/conftest.py); the entry points that the slow tests run, and every run
of the template, read their configs as Hydra does. A Hydra release without these private names leaves
Hydra as it is (tests/test_loaded_configs.py then says so).
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_loaded: dict[tuple[Any, ...], Any] = {}  # (source, config, file, mtime, size): what Hydra loaded
_hydras: list[Callable[..., Any]] = []  # Hydra's own load_config, once installed


def install() -> bool:
    """Keep what Hydra loads in this process; False where this Hydra has not the names relied on."""
    try:
        from hydra._internal.config_repository import ConfigRepository
        from hydra.core.object_type import ObjectType
        from hydra.plugins.config_source import ConfigSource
    except ImportError:
        return False
    if _hydras:
        return True
    hydras = ConfigRepository.load_config
    if not all(
        hasattr(x, name)
        for x, name in ((ConfigRepository, "_find_object_source"), (ConfigSource, "_normalize_file_name"))
    ):
        return False

    @functools.cache
    def file_of(scheme: str, where: str, config_path: str) -> str | None:
        """The file a file:// or pkg:// source reads for `config_path`; None for any other source."""
        name = ConfigSource._normalize_file_name(config_path)
        if scheme == "file":
            return os.path.realpath(os.path.join(where, name))
        if scheme == "pkg":
            from importlib import resources

            found = str(resources.files(where).joinpath(name))
            return found if os.path.isfile(found) else None  # not a file in a zip or the like
        return None

    def load_config(self: Any, config_path: str, *args: Any, **kwargs: Any) -> Any:
        source = None if args or kwargs else self._find_object_source(config_path, ObjectType.CONFIG)
        file = file_of(source.scheme(), source.path, config_path) if source is not None else None
        try:
            stat = os.stat(file) if file is not None else None
        except OSError:
            stat = None
        if stat is None:
            return hydras(self, config_path, *args, **kwargs)
        key = (
            source.scheme(),
            source.path,
            source.provider,
            config_path,
            file,
            stat.st_mtime_ns,
            stat.st_size,
        )
        if key not in _loaded:
            _loaded[key] = hydras(self, config_path)
        return copy.deepcopy(_loaded[key])

    ConfigRepository.load_config = load_config  # type: ignore[method-assign]
    _hydras.append(hydras)
    return True


def files_kept() -> int:
    """How many file versions this process keeps."""
    return len(_loaded)


@contextmanager
def as_hydra_reads() -> Iterator[None]:
    """Within: every file read by Hydra itself, as without `install` (to compare the two)."""
    from hydra._internal.config_repository import ConfigRepository

    if not _hydras:
        yield
        return
    ours = ConfigRepository.load_config
    ConfigRepository.load_config = _hydras[0]  # type: ignore[method-assign]
    try:
        yield
    finally:
        ConfigRepository.load_config = ours  # type: ignore[method-assign]
