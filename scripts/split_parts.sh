#!/usr/bin/env bash
# The one rule by which a file larger than a device call's room travels to the GPU machine: FILE split into
# $PARTS_DIR/NAME.part-a, -b, ... of PART_SIZE and $PARTS_DIR/NAME.sha256 (FILE's), checked by joining the parts
# again. A call carries the tracked tree (17-45 MiB) in its 64 MiB, so a part is 20 MiB by default: one travels
# beside the largest tree, two beside the smallest. benchmarks/h200_assets.sh stashes the carried parts on the warm
# machine (stash_parts) and joins them there (parts_joined). Callers: scripts/split_gguf.sh, scripts/split_weed.sh.
# Usage: [PART_SIZE=20M] [PARTS_DIR=.assets] scripts/split_parts.sh FILE NAME
set -euo pipefail
FILE=$1 NAME=$2 DIR=${PARTS_DIR:-.assets}
mkdir -p "$DIR"
rm -f "$DIR/$NAME".part-*
split -b "${PART_SIZE:-20M}" -a 1 "$FILE" "$DIR/$NAME.part-"
sha256sum "$FILE" | cut -d' ' -f1 > "$DIR/$NAME.sha256"
cat "$DIR/$NAME".part-* | sha256sum | cut -d' ' -f1 | diff - "$DIR/$NAME.sha256"
ls -l "$DIR/$NAME".part-*
