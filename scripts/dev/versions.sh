#!/usr/bin/env bash
# The quick tier against the oldest or the newest releases pyproject.toml's ranges allow (hpctrain's
# support window), each in a fresh virtual environment (.venv-oldest, .venv-newest) beside the locked .venv:
#
#   bash scripts/dev/versions.sh oldest     # the lowest version of every direct dependency (uv's lowest-direct)
#   bash scripts/dev/versions.sh newest     # the highest
#
# `make versions` runs both. The lock (uv.lock, what CI tests) is not touched.
set -euo pipefail
cd "$(dirname "$0")/../.."
which="${1:?oldest or newest}"
case "$which" in
    oldest) resolution=lowest-direct ;;
    newest) resolution=highest ;;
    *) echo "error: $which is not oldest or newest" >&2; exit 2 ;;
esac
venv=".venv-$which"
uv=".venv/bin/uv"
rm -rf "$venv"
"$uv" venv --quiet --python "$(.venv/bin/python -c 'import sys; print(sys.executable)')" "$venv"
# --no-config: the window is pyproject's ranges, not the cap [tool.uv] puts on the lock (torch<=2.14.1)
VIRTUAL_ENV="$venv" "$uv" pip install --no-config --quiet --resolution "$resolution" -e ".[dev]"
VIRTUAL_ENV="$venv" "$uv" pip list 2>/dev/null | grep -Ei '^(torch|torchvision|pytorch-lightning|lightning|torchmetrics|hydra-core|omegaconf) '
"$venv/bin/python" -m pytest -q -n 2 -m "not slow" -p no:cacheprovider
