"""Lightning's two namespaces, `pytorch_lightning` and `lightning.pytorch`, and which one a run trains with.

The same Lightning ships twice: as the `pytorch-lightning` package (`import pytorch_lightning as pl`, with
`lightning_fabric`) and inside the `lightning` package (`import lightning as L`, `lightning.pytorch` and
`lightning.fabric`). The code is the same, the classes are not: each Trainer accepts only modules,
datamodules, callbacks, strategies, plugins and loggers of its own namespace (it checks `isinstance`
against its own classes). So a run picks one, once, from the user's classes (`choose`), and everything
hpctrain builds for that run is of that namespace:

- the user's classes decide: a LightningModule, LightningDataModule, Callback, Logger or Trainer subclass
  carries its namespace in its bases (`namespace_of`); two that disagree are one sentence, before
  anything is built; none that decides leaves the declared package, pytorch_lightning;
- Lightning's own classes named in the config (`pytorch_lightning.Trainer`, a LearningRateMonitor) are
  built from the run's namespace (`Namespace.spell`);
- hpctrain's own (its callbacks, loggers, strategies, cluster environments, checkpoint IO, the image
  datamodules) are written once, without a Lightning base: a `LightningPart` names the Lightning class
  it extends (`lightning="pytorch_lightning.Callback"`), and each namespace gets its own subclass of it
  with that base (`Namespace.part`). Constructing a part makes it of the namespace the run's build chose
  (`building`), else of pytorch_lightning: a notebook or a test that constructs one gets what it got
  before either namespace was taken.

Nothing here patches or aliases either library: both may be imported in one process, each stays as it is.
Standard library only (Lightning is imported when a namespace is asked for a class): below every layer.
"""

from __future__ import annotations

import contextvars
import copyreg
import functools
import importlib
import inspect
import sys
import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from hpctrain.runtime.errors import UserError

T = TypeVar("T")


@dataclass(frozen=True)
class Namespace:
    """One of Lightning's two namespaces: its trainer package and its fabric package."""

    package: str  # pytorch_lightning | lightning.pytorch
    fabric: str  # lightning_fabric | lightning.fabric
    import_line: str  # how code imports it, as Lightning's own docs write it

    def __str__(self) -> str:
        return self.package

    def spell(self, path: str) -> str:
        """A dotted path of Lightning's (either spelling) in this namespace's: `pytorch_lightning.Trainer`
        is `lightning.pytorch.Trainer` in the other. Any other path is returned as it is."""
        for namespace in NAMESPACES:
            for theirs, ours in ((namespace.package, self.package), (namespace.fabric, self.fabric)):
                if path == theirs or path.startswith(f"{theirs}."):
                    return ours + path[len(theirs) :]
        return path

    def get(self, path: str) -> Any:
        """The object a dotted Lightning path names, in this namespace (`pytorch_lightning.Callback`)."""
        return located(self.spell(path))

    def part(self, neutral: type[T]) -> type[T]:
        """This namespace's class of the `LightningPart` `neutral` (made once, then the same class)."""
        return _part_class(self, neutral)

    def is_overridden(self, method: str, instance: Any) -> bool:
        """Lightning's `is_overridden` of this namespace (it compares with its own base classes)."""
        return self.get("pytorch_lightning.utilities.model_helpers.is_overridden")(method, instance)


PYTORCH_LIGHTNING = Namespace("pytorch_lightning", "lightning_fabric", "import pytorch_lightning as pl")
LIGHTNING = Namespace("lightning.pytorch", "lightning.fabric", "import lightning as L")
NAMESPACES = (PYTORCH_LIGHTNING, LIGHTNING)
DECLARED = PYTORCH_LIGHTNING  # the package pyproject.toml declares: the namespace when no class decides


def owner(path: str) -> Namespace | None:
    """The namespace a dotted path (a module's name, a `_target_`) lies in, if it is Lightning's."""
    for namespace in NAMESPACES:
        for package in (namespace.package, namespace.fabric):
            if path == package or path.startswith(f"{package}."):
                return namespace
    return None


def namespace_of(cls: type | Any) -> Namespace | None:
    """The namespace a class (or an object's class) is built on: the first Lightning class among its
    bases. None for a class of neither (an nn.Module, a function's result, a `LightningPart` itself)."""
    if not isinstance(cls, type):
        cls = type(cls)
    for base in cls.__mro__:
        found = owner(getattr(base, "__module__", "") or "")
        if found is not None:
            return found
    return None


def is_overridden(method: str, instance: Any) -> bool:
    """Lightning's `is_overridden` of the namespace `instance` is of (each compares with its own base
    classes, and refuses an object of the other's); the declared one's for an object of neither."""
    return (namespace_of(instance) or DECLARED).is_overridden(method, instance)


def located(path: str) -> Any:
    """What a dotted path names, imported: the longest importable module, then its attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as err:
            if err.name is None or not ".".join(parts[:i]).startswith(err.name):
                raise  # the module exists but imports something missing
            continue
        for attribute in parts[i:]:
            obj = getattr(obj, attribute)
        return obj
    raise ModuleNotFoundError(f"No module named {parts[0]!r}", name=parts[0])


class LightningPart:
    """A class of hpctrain's that extends a Lightning class without inheriting it, so that it serves
    either namespace: `class ModelCheckpoint(LightningPart, lightning="pytorch_lightning.callbacks.
    ModelCheckpoint")`. Its methods are written as in a subclass (`super()` reaches Lightning's);
    `Namespace.part` makes the subclass with the namespace's base, and constructing the class makes an
    object of that subclass, of the namespace being built (`building`). `isinstance(x, ModelCheckpoint)`
    holds for both namespaces' objects. Subclasses (a project's datamodule of `hpctrain.data`'s bases)
    are parts too."""

    lightning_base: ClassVar[str] = ""

    def __init_subclass__(cls, lightning: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if lightning is not None:
            cls.lightning_base = lightning

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        made = cls if namespace_of(cls) is not None else current().part(cls)
        return super(LightningPart, made).__new__(made)

    @property
    def namespace(self) -> Namespace:
        """The namespace this object was made of (what it builds further parts of)."""
        found = namespace_of(self)
        assert found is not None  # every part object is of a namespace's class (`__new__`)
        return found

    def __reduce_ex__(self, protocol: Any) -> Any:
        # A part's class is made at run time, so pickle cannot find it by name: it is named by its neutral
        # class and namespace (a loader worker started by spawn or forkserver gets the same class).
        reduced = super().__reduce_ex__(protocol)
        made = _MADE_FROM.get(type(self))
        if made is None or not isinstance(reduced, tuple) or reduced[0] is not copyreg.__newobj__:
            return reduced
        neutral, namespace = made
        return (_new_part, (neutral, namespace.package, *reduced[1][1:]), *reduced[2:])


_MADE_FROM: dict[type, tuple[type, Namespace]] = {}  # each made class -> (its neutral class, namespace)


@functools.cache
def _part_class(namespace: Namespace, neutral: type) -> type:
    if not (isinstance(neutral, type) and issubclass(neutral, LightningPart)):
        raise TypeError(f"{neutral!r} is not a LightningPart")
    found = namespace_of(neutral)
    if found is namespace:
        return neutral
    if found is not None:
        raise TypeError(f"{neutral.__qualname__} is already a class of {found}, not of {namespace}")
    base = namespace.get(neutral.lightning_base)
    # the same name, module and qualified name as the neutral class: Lightning keys a callback's state in
    # a checkpoint by `__qualname__`, so both namespaces' runs read each other's checkpoints
    keep = {k: getattr(neutral, k) for k in ("__module__", "__qualname__", "__doc__")}
    made = types.new_class(neutral.__name__, (neutral, base), exec_body=lambda body: body.update(keep))
    _MADE_FROM[made] = (neutral, namespace)
    return made


def _new_part(neutral: type, package: str, *args: Any) -> Any:
    made = next(n for n in NAMESPACES if n.package == package).part(neutral)
    return made.__new__(made, *args)


_BUILDING: contextvars.ContextVar[Namespace | None] = contextvars.ContextVar(
    "lightning_namespace", default=None
)


def being_built() -> Namespace | None:
    """The namespace a build is building now (`building`), if one is."""
    return _BUILDING.get()


def current() -> Namespace:
    """The namespace parts constructed now are of: the run's while its build runs, else the declared one."""
    return _BUILDING.get() or DECLARED


@contextmanager
def building(namespace: Namespace) -> Iterator[Namespace]:
    """Within the block, every `LightningPart` constructed is of `namespace` (a run's build enters it once)."""
    token = _BUILDING.set(namespace)
    try:
        yield namespace
    finally:
        _BUILDING.reset(token)


def _where(cls: type) -> str:
    """The file a class is written in, for the sentence that asks for its imports to change."""
    try:
        return inspect.getsourcefile(cls) or cls.__module__
    except TypeError:
        module = sys.modules.get(cls.__module__)
        return getattr(module, "__file__", None) or cls.__module__


def _named(cls: type) -> tuple[str, str]:
    return f"{cls.__module__}.{cls.__qualname__}", _where(cls)


def choose(named: Mapping[str, type]) -> Namespace:
    """The namespace of a run from the classes it is given (config key -> class): the one their bases
    are of, the declared one if none is of either; classes of both are one sentence naming one of each."""
    decided: dict[Namespace, tuple[str, type]] = {}
    for key, cls in named.items():
        namespace = namespace_of(cls)
        if namespace is not None:
            decided.setdefault(namespace, (key, cls))
    if len(decided) > 1:
        (one, (key, cls)), (other, (other_key, other_cls)) = list(decided.items())[:2]
        (name, file), (other_name, other_file) = _named(cls), _named(other_cls)
        raise MixedNamespaces(
            f"{key}: {name} is written with {one} (`{one.import_line}`, in {file}), but {other_key}: "
            f"{other_name} is written with {other} (`{other.import_line}`, in {other_file}); one run trains under "
            "one Trainer, which accepts the classes of its own package only: write one of the two files with the "
            "other's imports (either package runs here)."
        )
    return next(iter(decided), DECLARED)


def check_built(key: str, obj: Any, namespace: Namespace) -> None:
    """What a factory returned (its class cannot be known before) is of the run's namespace, or one sentence."""
    found = namespace_of(obj)
    if found is not None and found is not namespace:
        name, file = _named(type(obj))
        raise MixedNamespaces(
            f"{key}: {name} is written with {found} (`{found.import_line}`, in {file}), but this run trains with "
            f"{namespace} (`{namespace.import_line}`, as its model's and other classes' imports say); one Trainer "
            f"accepts the classes of its own package only: write {file} with the run's imports."
        )


class MixedNamespaces(UserError):
    """Classes of both of Lightning's namespaces given to one run."""
