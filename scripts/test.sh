#!/usr/bin/env bash
# Sets up the environment (scripts/env.sh) and runs the CPU test suite. Extra arguments go to pytest.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck disable=SC1091
. "$ROOT/scripts/env.sh"
cd "$ROOT"
exec python -m pytest "$@"
