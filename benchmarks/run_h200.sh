#!/usr/bin/env bash
# The GPU measurements, sized so that each stage fits one device call (10 min). Run from the repo root on the
# H200 machine with the carried wheels in .whl/ (zarr, numcodecs, donfig, google-crc32c, crc32c, msgspec,
# fla-core, flash-linear-attention, gguf; see the README of the device tool):
#   bash benchmarks/run_h200.sh io      # bench_cache (~2 min) + bench_extract 400K tokens (~4 min)
#   bash benchmarks/run_h200.sh train   # bench_train with fused vs checkpointed LM-head loss (~5 min)
#   bash benchmarks/run_h200.sh sweep   # bench_sweep --synthetic (27B features, 4 drafters)
# Results land in benchmarks/results/*_h200.json and are copied to $OUT when set.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
case "${1:-io}" in
  io)
    timeout 170 python3 benchmarks/bench_cache.py --tokens 200000 --drop-caches --threads 16 --result-name h200
    rm -rf /tmp/dflash_bench_cache
    timeout 330 python3 benchmarks/bench_extract.py --tokens 400000 --peer-tokens 12000 --fla-conv ;;
  train)
    timeout 560 python3 benchmarks/bench_train.py --compare-loss-impl ;;
  sweep)
    timeout 560 python3 benchmarks/bench_sweep.py --synthetic ;;
  *) echo "usage: $0 io|train|sweep" >&2; exit 2 ;;
esac
rc=$?
[ -n "${OUT:-}" ] && cp benchmarks/results/*_h200.json "$OUT"/ 2>/dev/null
exit $rc
