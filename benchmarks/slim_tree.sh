#!/usr/bin/env bash
# A device call carries the working tree plus what `carry` names, 64 MiB in all. The tracked sampled regenerations
# (benchmarks/assets/quality/sharegpt_sampled_*, ~29 MiB of the tree's ~44.5) are read only by the reference stages,
# and a call that carried the whole tree once leaves them stashed on the machine (h200_assets.sh puts them back into
# a later call's slim tree), so they can stay behind: with them out, one call carries two 20 MiB GGUF parts,
# or .whl and one part, or three 15 MiB checkpoint parts, where it carries one with them in.
#   bash benchmarks/slim_tree.sh out     # before the session's calls: removes them from the working tree
#   bash benchmarks/slim_tree.sh back    # after: restores them from git
# While they are out, `git status` lists them as deleted: commit named paths only (never `git commit -a`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SAMPLED=benchmarks/assets/quality/sharegpt_sampled_*.jsonl.gz
case "${1:-}" in
  out) rm -f $SAMPLED; echo "tree without the sampled regenerations: $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -n1 | cut -f1) bytes" ;;
  back) git checkout -- 'benchmarks/assets/quality/sharegpt_sampled_*.jsonl.gz'; echo "sampled regenerations restored" ;;
  *) echo "usage: $0 out|back" >&2; exit 2 ;;
esac
