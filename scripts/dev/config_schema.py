"""Write the JSON Schemas editors use to complete and validate conf/*.yaml (from hpctrain.runtime.config.schema).

    python scripts/dev/config_schema.py          # writes src/hpctrain/conf/schema/*.json and .vscode/settings.json
    python scripts/dev/config_schema.py --check  # exit 1 if they are not up to date (the tests run this)

In VS Code, install Red Hat's YAML extension (redhat.vscode-yaml); .vscode/settings.json maps each
schema to the config files it describes, so keys complete and wrong values are underlined as you type.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from generated import write_or_check  # noqa: E402

from hpctrain.runtime.config.schema import FILE_PREFIXES, json_schema  # noqa: E402

# which config files each schema describes (files of @package _global_ groups describe the whole config):
# the project's conf/ and hpctrain's, whose groups a project may also add options to
PACKAGE_CONF = "src/hpctrain/conf"
FILES = {
    "train": [
        "conf/train.yaml",
        "conf/eval.yaml",
        "conf/export.yaml",
        "conf/experiment/*.yaml",
        "conf/debug/*.yaml",
        f"{PACKAGE_CONF}/debug/*.yaml",
        "conf/local/*.yaml",
    ],
    "trainer": ["conf/trainer/*.yaml", f"{PACKAGE_CONF}/trainer/*.yaml"],
    "data": ["conf/data/*.yaml"],
    "model": ["conf/model/*.yaml"],
    "model/optimizer": ["conf/model/optimizer/*.yaml"],
    "paths": ["conf/paths/*.yaml", f"{PACKAGE_CONF}/paths/*.yaml"],
    "cluster": ["conf/cluster/*.yaml", f"{PACKAGE_CONF}/cluster/*.yaml"],
}


def schema_file(group: str) -> str:
    return f"{PACKAGE_CONF}/schema/{group.replace('/', '.')}.schema.json"


def rendered() -> dict[str, str]:
    files = {schema_file(g): json.dumps(json_schema(FILE_PREFIXES[g]), indent=2) + "\n" for g in FILES}
    settings = {"yaml.schemas": {schema_file(g): globs for g, globs in FILES.items()}}
    files[".vscode/settings.json"] = json.dumps(settings, indent=2) + "\n"
    return files


def main() -> int:
    return write_or_check(ROOT, rendered, __doc__.split("\n\n")[0], "scripts/dev/config_schema.py")


if __name__ == "__main__":
    sys.exit(main())
