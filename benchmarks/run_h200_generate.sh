#!/usr/bin/env bash
# Regeneration on the H200 (issue 14): bench_generate (HF eager generate vs the compiled static-cache path) and
# the whole-conversation regeneration of the ShareGPT package with the real SmolLM2 target, spread over
# device calls of at most 10 minutes on one warm machine. Inputs travel in .assets/ (git-ignored):
# smollm2.gguf.part-a / part-b (scripts/split_gguf.sh) and sharegpt_users.jsonl.gz (the package's 17,392
# conversations, user turns kept, assistant turns blanked to ".": they are regenerated). Stages:
#   bash benchmarks/run_h200_generate.sh stash      # call 1 (.whl + part-a): install wheels, keep part-a, GPU tests
#   bash benchmarks/run_h200_generate.sh bench      # call 2 (part-b + data): model, bench_generate, regeneration
#   bash benchmarks/run_h200_generate.sh regen      # call 3..: continue the regeneration
# bench and regen copy the packed regenerated conversations (benchmarks/pack_regen.py) and the results to $OUT.
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
ASSETS=$HOME/dflash_assets
MODEL=$ASSETS/smollm2-hf
REGEN=$ASSETS/regen/sharegpt_regen.jsonl.gz
LOGS=${OUT:-/tmp}
T0=$(date +%s)
left() { echo $(( ${1:-590} - ($(date +%s) - T0) )); }

model() {
  [ -f "$MODEL/dflash-asset.json" ] && return 0
  cat "$ASSETS/smollm2.gguf.part-a" .assets/smollm2.gguf.part-b > "$ASSETS/smollm2.gguf" || return 1
  python3 -c "from dflash.target.assets import convert_gguf_to_hf as c; print(c('$ASSETS/smollm2.gguf', '$MODEL'))"
}
regen() {  # $1: seconds this stage may take
  cp -n .assets/sharegpt_users.jsonl.gz "$ASSETS/" 2>/dev/null
  timeout "$1" python3 -m cli.main generate --model "$MODEL" --data "$ASSETS/sharegpt_users.jsonl.gz" \
    --output "$REGEN" --turns all --max-new-tokens 256 --max-length 2048 --batch-size 512 \
    --chunk-conversations 2048 --stop-after $(( $1 - 25 )) 2>&1 | tr '\r' '\n' | grep -v "^generate: .*it/s\]$" | tail -n 40
  python3 benchmarks/pack_regen.py "$REGEN" "$LOGS"
}

stage=${1:-}
rc=0
case "$stage" in
  stash)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || exit 1
    mkdir -p "$ASSETS" && cp .assets/smollm2.gguf.part-a "$ASSETS/" || exit 1
    timeout "$(left 540)" python3 -m pytest -q -p no:cacheprovider -W ignore::Warning -m gpu tests/gpu \
      tests/unit/test_attention_tiles.py tests/unit/test_drafter_model.py 2>&1 | tail -n 30 || rc=$? ;;
  bench)
    model || exit 1
    timeout 300 python3 benchmarks/bench_generate.py --model "$MODEL" --data .assets/sharegpt_users.jsonl.gz \
      2>&1 | tail -n 30 || rc=$?
    cp benchmarks/results/generate_h200.json "$LOGS/" 2>/dev/null
    regen "$(left 585)" || rc=$? ;;
  regen) regen "$(left 585)" || rc=$? ;;
  *) echo "usage: $0 stash|bench|regen" >&2; exit 2 ;;
esac
exit $rc
