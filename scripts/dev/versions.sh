#!/usr/bin/env bash
# The quick tier against the oldest or the newest releases pyproject.toml's ranges allow (hpctrain's
# support window), each in a fresh virtual environment (.venv-oldest, .venv-newest) beside the locked .venv:
#
#   bash scripts/dev/versions.sh oldest        # the lowest version of every direct dependency (uv's lowest-direct)
#   bash scripts/dev/versions.sh newest        # the highest
#   bash scripts/dev/versions.sh newest --pre  # the highest, with the next Hydra and OmegaConf (pre-releases
#                                              # allowed, the ranges' caps on them lifted): .venv-next
#
# `make versions` runs oldest and newest; `make versions PRE=1` adds the pre-release run. Hydra's
# deprecations are errors in every run (HYDRA_DEPRECATION_WARNINGS_AS_ERRORS): a target instantiated
# without Hydra 1.4's call-site allowlist fails the tier instead of warning. The lock (uv.lock, what CI
# tests) is not touched.
set -euo pipefail
cd "$(dirname "$0")/../.."
which="${1:?oldest or newest}"
pre="${2:-}"
case "$which" in
    oldest) resolution=lowest-direct ;;
    newest) resolution=highest ;;
    *) echo "error: $which is not oldest or newest" >&2; exit 2 ;;
esac
venv=".venv-$which"
extra=()
if [ -n "$pre" ]; then
    [ "$pre" = "--pre" ] && [ "$which" = newest ] || { echo "error: only 'newest --pre' takes a flag, not '$which $pre'" >&2; exit 2; }
    venv=".venv-next"
    overrides="$(mktemp)"
    trap 'rm -f "$overrides"' EXIT
    # the next minor releases of the config libraries, release candidates included
    printf '%s\n' "hydra-core>=1.4.0rc1,<1.5" "omegaconf>=2.4.0rc1,<2.5" >"$overrides"
    extra=(--prerelease allow --override "$overrides")
fi
uv=".venv/bin/uv"
rm -rf "$venv"
"$uv" venv --quiet --python "$(.venv/bin/python -c 'import sys; print(sys.executable)')" "$venv"
# --no-config: the window is pyproject's ranges, not the cap [tool.uv] puts on the lock (torch<=2.14.1)
VIRTUAL_ENV="$venv" "$uv" pip install --no-config --quiet --resolution "$resolution" "${extra[@]}" -e ".[dev]"
VIRTUAL_ENV="$venv" "$uv" pip list 2>/dev/null | grep -Ei '^(torch|torchvision|pytorch-lightning|lightning|torchmetrics|hydra-core|omegaconf) '
HYDRA_DEPRECATION_WARNINGS_AS_ERRORS=1 "$venv/bin/python" -m pytest -q -n 2 -m "not slow" -p no:cacheprovider
