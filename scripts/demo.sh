#!/usr/bin/env bash
# The README's main job: sets up the environment (scripts/env.sh: creates .venv and installs on first use), then
# runs the whole pipeline on SmolLM2-135M + ShareGPT (`dflash demo`). Extra arguments go to `dflash demo`,
# e.g. `bash scripts/demo.sh --fresh` or `bash scripts/demo.sh --output /tmp/demo --steps 600`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck disable=SC1091
. "$ROOT/scripts/env.sh"
exec dflash demo "$@"
