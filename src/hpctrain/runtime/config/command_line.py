"""The entry points' one hook into Hydra's command line, and the private Hydra 1.3 names it relies on.

`@hydra.main` runs the steps of a command (creating the app, `--cfg`, a run) through
`hydra._internal.utils.run_and_report`, looked up at call time. `install` wraps it, once per process:
- a mistake Hydra finds while composing the config becomes one `error:` sentence and exit 2
  (`hpctrain.runtime.config.hydra_errors.describe_hydra_error`);
- the app it creates lists config groups (`--help`) straight from its config repository. Hydra
  builds a new repository for each listing, deep-copying every structured schema it holds: one
  listing per group and option, a cost that grows with every group added. Asked
  without a primary config and without overrides, as `--help` asks, that copy lists exactly what
  the repository does, so each listing is read once from the repository itself;
- the answers of `--help`, `--hydra-help` and `--cfg job` are stored for the next identical question
  (`hpctrain.runtime.config.answers`).

Private names, and the tests that fail if a Hydra upgrade changes them:
- `hydra._internal.utils.run_and_report`: tests/test_train.py::test_unknown_override_key_fails_naming_the_key,
  tests/test_config.py::test_help_builds_one_config_repository;
- `hydra._internal.hydra.Hydra` and its `config_loader`'s `get_group_options` and `repository`:
  tests/test_config.py::test_help_builds_one_config_repository and
  ::test_help_lists_every_config_group_and_option;
- `Hydra.app_help`, `Hydra.hydra_help` and `Hydra.show_cfg` printing their answers to stdout:
  tests/test_config.py::test_a_repeated_question_is_answered_again_until_what_it_depends_on_changes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from hpctrain.runtime.config import answers, redact
from hpctrain.runtime.config.compose import CODE_ROOT, HPCTRAIN_CONF_DIR, config_dirs, config_groups
from hpctrain.runtime.errors import EXIT_USER_ERROR


def install(config_name: str, answer_key: str | None = None) -> None:
    """Wrap Hydra's `run_and_report` for `python src/<config_name>.py` (see the module docstring);
    `answer_key`: where `answers` stores this command line's answer (None: not stored)."""
    import hydra._internal.utils as hydra_utils  # Hydra waits: a stored answer (answers) is printed before it is imported
    from hydra._internal.hydra import Hydra

    original = hydra_utils.run_and_report
    if getattr(original, "installed_by_hpctrain", False):
        original.answer_key = answer_key  # type: ignore[attr-defined]  # this command line's, not the last one's
        return

    def run_and_report(func: Callable[[], Any]) -> Any:
        try:
            result = func()
        except Exception as err:
            from hpctrain.runtime.config.hydra_errors import describe_hydra_error  # Hydra's errors: heavy

            full = os.environ.get("HYDRA_FULL_ERROR") == "1"
            sentence = None if full else describe_hydra_error(err, config_name)
            if sentence is None:
                failure = err

                def reraise() -> Any:
                    raise failure

                return original(reraise)
            print(f"error: {redact.text(sentence)}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
        if isinstance(result, Hydra):
            _list_groups_from_the_repository(result)
            result.app_help = _with_config_sources(result.app_help)
            for name in ("app_help", "hydra_help", "show_cfg"):  # stored for the next identical question
                setattr(result, name, answers.remembering(getattr(result, name), run_and_report.answer_key))  # type: ignore[attr-defined]
        return result

    run_and_report.installed_by_hpctrain = True  # type: ignore[attr-defined]
    # the key lives on the hook Hydra calls (process-wide, like the hook itself), set again by each install
    run_and_report.answer_key = answer_key  # type: ignore[attr-defined]
    hydra_utils.run_and_report = run_and_report


def _with_config_sources(app_help: Callable[..., None]) -> Callable[..., None]:
    """`--help` ends by saying where the configs come from and which of hpctrain's the project replaces."""

    def app_help_with_sources(*args: Any, **kwargs: Any) -> None:
        app_help(*args, **kwargs)
        print(config_sources())

    return app_help_with_sources


def config_sources() -> str:
    project, package = config_dirs()
    replaced = [
        f"{group}/{option}"
        for group in config_groups()
        for option in sorted(p.stem for p in (project / group).glob("*.yaml"))
        if (package / group / f"{option}.yaml").is_file()
    ]
    where = (
        HPCTRAIN_CONF_DIR.relative_to(CODE_ROOT)
        if HPCTRAIN_CONF_DIR.is_relative_to(CODE_ROOT)
        else HPCTRAIN_CONF_DIR
    )
    lines = [
        f"Configs are read from conf/ (this project's), then from hpctrain's ({where}); a file of the same "
        "group and name in conf/ replaces hpctrain's.",
        f"Options of hpctrain's that this project replaces: {', '.join(replaced) if replaced else 'none'}",
    ]
    return "\n".join(lines)


def _list_groups_from_the_repository(app: Any) -> None:
    """Answer this app's plain group listings from its repository, each once (this instance only)."""
    from hydra.core.object_type import ObjectType  # only when Hydra runs (see install)

    loader = app.config_loader
    full_listing = loader.get_group_options
    listed: dict[tuple[str, Any], list[str]] = {}

    def get_group_options(
        group_name: str,
        results_filter: ObjectType | None = ObjectType.CONFIG,
        config_name: str | None = None,
        overrides: list[str] | None = None,
    ) -> list[str]:
        if config_name is not None or overrides:  # these can move the search path: Hydra's own way
            return full_listing(group_name, results_filter, config_name, overrides)
        key = (group_name, results_filter)
        if key not in listed:
            listed[key] = loader.repository.get_group_options(group_name, results_filter)
        return list(listed[key])

    loader.get_group_options = get_group_options
