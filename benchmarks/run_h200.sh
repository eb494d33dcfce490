#!/usr/bin/env bash
# The GPU measurements on the H200 machine, each stage sized for one device call (10 minutes). Run from the repo
# root with the carried wheels in .whl/ (scripts/fetch_gpu_wheels.sh) and, for SmolLM2 stages, the GGUF parts
# of scripts/split_gguf.sh stashed on the machine (benchmarks/h200_assets.sh), one or two parts per call.
#   bash benchmarks/run_h200.sh STAGE [ARGS]      (LIMIT=<seconds> caps a stage's own time limit: set it under
#   the call's timeout, so the bench stops itself and its JSON comes back through $OUT)
# Stages (what each measures and its result file: benchmarks/README.md):
#   io | cache | extract [ARGS]      bench_cache (cold reads, ~4 min) and/or bench_extract 600K tokens (~7 min)
#   train [ARGS] | trainreal [ARGS] | steptail   bench_train, bench_train_real, bench_step_tail (27B drafter)
#   sweep | check [ARGS]             bench_sweep --synthetic; the gpu-marked tests + bench_block_mask, across calls
#   quality GGUF_PART... [--resume]  bench_quality (SmolLM2, bf16 vs fp8, 3 seeds)
#   reference [ARGS] [--resume]      bench_reference on the committed data (every call after the first: --resume)
#   shuffleeffect [N]                the reference run with train --shuffle-block N (all_shuffle), across calls
#   refpair | refone fp8|bf16        fp8 vs bf16 at the reference point: both on a 2-GPU machine, or one per session
#   evaloverhead                     bench_eval_overhead on the reference run's 8K cache
#   storage4 extract|train|tau       bench_storage4
#   smollm2step [ARGS]               bench_smollm2_step (where the SmolLM2 drafter's step goes)
#   peer [ARGS]                      bench_peer: SpecForge's DFlash trainer side by side (peer snapshots in shared/)
#   peerx [ARGS] | peerout PART...   bench_peer --scale x10 across sessions; the SpecForge checkpoint parts back
#   stretch [ARGS] | stretchout PART...   the reference run's stretch across sessions; its checkpoint parts back
#   methods [ARGS]                   bench_reference --methods (DFlash, DFlash 2, variable prefix) across sessions
#   stash                            nothing but stashing the carried GGUF / weed / checkpoint parts, regenerations
#   flextiles [ARGS]                 bench_flex_tiles (flex attention tile options, no target needed)
#   storegpu [ARGS]                  bench_store, SeaweedFS and client on halves of the cores (weed parts stashed)
#   pair1 | pair2 PARTS | pair3 | pair4 PARTS   two stages at once on a 2-GPU machine, one GPU each
# Results land in benchmarks/results/*_h200.json and, with logs, are copied to $OUT when set. Session recipes
# (which calls to chain, what to carry, how long each takes): benchmarks/README.md, "GPU sessions".
set -u
. benchmarks/h200_assets.sh
stash_parts
# a later call on the warm machine may carry no wheels: what an earlier call installed in /tmp/site serves
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
elif [ ! -d /tmp/site/zarr ]; then
  echo "run_h200.sh: no .whl/*.whl carried and none installed in /tmp/site (carry .whl)" >&2; exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOGS=${OUT:-/tmp}
START=$(mktemp /tmp/run_h200_start.XXXXXX)

# every stage's time limit, capped by LIMIT=<seconds> when set: a call under the device time a session has left (or
# under the call's own limit) stops the bench itself, so the results it wrote still come back through $OUT below
limit() { if [ -n "${LIMIT:-}" ] && [ "$LIMIT" -lt "$1" ]; then echo "$LIMIT"; else echo "$1"; fi; }
capped() { local t; t=$(limit "$1"); shift; timeout "$t" "$@"; }
cache() { capped 330 python3 benchmarks/bench_cache.py --tokens 200000 --drop-caches --threads 16 --reps 3 \
            --cache-threads 32,64 --result-name h200
          rm -rf /tmp/dflash_bench_cache; }
extract() { capped "${1:-410}" python3 benchmarks/bench_extract.py --tokens 600000 --peer-tokens 100000 --fla-conv \
              "${@:2}"; }
train() { capped 560 python3 benchmarks/bench_train.py --compare-compile --profile-steps 2 "$@"; }
sweep() { capped "${1:-560}" python3 benchmarks/bench_sweep.py --synthetic; }
trainreal() { capped 560 python3 benchmarks/bench_train_real.py "$@"; }
steptail() { capped "${1:-240}" python3 benchmarks/bench_step_tail.py; }
quality() { local t=$1; shift
            capped "$t" python3 benchmarks/bench_quality.py --train-prompts 2000 --steps 400 --seeds 3 --workdir /tmp/bq \
              --json /tmp/bq/quality_smollm2.json --gguf-parts "$@"; }  # outside the synced tree: --resume reads it

reference() { local t=$1; shift; local w=${REF_WORK:-/tmp/bref}; mkdir -p "$w"
              # a new session's first --resume call continues from the committed JSON (bench_reference redoes the
              # target, eval cache and training caches a fresh machine lacks and keeps the finished runs)
              if [[ " $* " == *" --resume "* && ! -f $w/quality_reference_h200.json \
                    && -f benchmarks/results/quality_reference_h200.json ]]; then
                cp benchmarks/results/quality_reference_h200.json "$w"/; fi
              gguf_joined || return 1
              capped "$t" python3 benchmarks/bench_reference.py --workdir "$w" --gguf "$GGUF" \
                --json "$w/quality_reference_h200.json" "$@"  # outside the synced tree: --resume reads it
              local r=$?
              # the eval responses travel back, for the next session's --eval-responses (same eval cache)
              if [ -n "${OUT:-}" ] && [ -z "${REF_PAIR:-}" ]; then
                for f in mtbench_greedy humaneval_greedy sharegpt_greedy; do
                  [ -f "$w/$f.jsonl" ] && gzip -c "$w/$f.jsonl" > "$OUT/$f.jsonl.gz"; done; fi
              return $r; }
# two reference calls at once, GPU 0 and GPU 1 of a 2-GPU machine, each in its own workdir from the committed
# JSON: fp8 vs bf16 at the reference point, each trained online alone (0.270 s a step against 0.403 s for the two
# as one sweep group on one GPU: smollm2_step_online_h200.json), all_fp8 on GPU 0 and all_bf16 on GPU 1. Their
# JSONs come back as quality_reference_gpu0_h200.json / _gpu1_; here: cp the first to
# results/quality_reference_h200.json, then
# `python benchmarks/bench_reference.py --json benchmarks/results/quality_reference_h200.json --merge GPU1_JSON`
REF_DATA=(--train-data benchmarks/assets/quality/sharegpt_whole-0*.jsonl.gz
          benchmarks/assets/quality/sharegpt_sampled_t0.8_s1-0*.jsonl.gz --storage int4 --epochs 2
          --eval-responses benchmarks/assets/peer --drop-caches --resume --compare-online --online-compile on
          --skip all_noise,all_seed1,all_seqnorm)
ref_gpu0() { REF_PAIR=1 REF_WORK=/tmp/bref reference "$1" "${REF_DATA[@]}" --also-storages fp8 \
               --skip all_bf16,all_noise,all_seed1,all_seqnorm --plot-dir /tmp/bref/plots; }
ref_gpu1() { REF_PAIR=1 REF_WORK=/tmp/bref1 reference "$1" "${REF_DATA[@]}" --plot-dir /tmp/bref1/plots; }
# a half's JSON back through $OUT under its GPU's name: ref_out gpu0 (fp8, /tmp/bref) | gpu1 (bf16, /tmp/bref1)
ref_out() { local w=/tmp/bref; [ "$1" = gpu1 ] && w=/tmp/bref1
            if [ -n "${OUT:-}" ] && [ -f "$w/quality_reference_h200.json" ]; then
              cp "$w/quality_reference_h200.json" "$OUT/quality_reference_$1_h200.json"; fi; }
refpair() { gguf_joined || return 1  # once, before the two calls would join it at the same time
            both ref_gpu0 "ref_gpu0 $1" ref_gpu1 "ref_gpu1 $1"
            ref_out gpu0; ref_out gpu1; }
# one half of refpair alone on a 1-GPU machine, one session each (2026-12-04: the fp8 + bf16 group on one GPU steps
# in 0.33-0.39 s even with compiled target layers and the drafter's 64 x 64 flex tiles, ~26 min for 4,088 steps, more
# than a session holds; one online run alone steps in ~0.23-0.25 s: ~17 min + ~3 min of set-up). Every call of the
# session the same command (LIMIT=<seconds> for its last); the JSON comes back as quality_reference_gpu0_h200.json
# (fp8) or _gpu1_ (bf16), merged here as for refpair
refone() { local g r
           case "${2:-}" in
             fp8) g=gpu0 ;;
             bf16) g=gpu1 ;;
             *) echo "run_h200.sh refone fp8|bf16" >&2; return 2 ;;
           esac
           "ref_$g" "$1"; r=$?
           ref_out "$g"; return $r; }
evaloverhead() { capped "${1:-560}" python3 benchmarks/bench_eval_overhead.py --model /tmp/bref/smollm2-hf \
                   --train-cache /tmp/bref/cache_train_n8000 --eval-cache /tmp/bref/cache_eval --workdir /tmp/bevo; }

peer() { gguf_joined || return 1; mkdir -p /tmp/peer
         # SpecForge is stopped at 535 s, before this call's own 570 s limit, so the JSON records how far it got
         # (specforge_cut) instead of the whole bench being killed unrecorded
         capped 570 python3 benchmarks/bench_peer.py --gguf "$GGUF" --wheels .whl --workdir /tmp/peer/work \
           --json /tmp/peer/peer_specforge_h200.json --specforge-timeout 535 "$@"; }  # outside the synced tree: --resume reads it
# the peer at 10x (issue 52 item 1: ~11,750 samples, SpecForge ~50 min, across sessions: benchmarks/README.md, "The
# peer at 10x"). Every call the same `peerx [ARGS]`; the JSON lives outside the synced tree and a new session's first
# call seeds it from the committed benchmarks/results/peer_specforge_h200.json (when it is a --scale x10 run), so
# the finished stages are kept and only the cheap ones (target, training set, eval caches) are redone. SpecForge's
# checkpoint parts: packed into $PEER_PACK on a cut (peerout brings them back), carried in as .assets/peer_ckpt/*
# (stashed into $PEER_PARTS like the GGUF parts, as many ~15 MiB parts a call as fit: benchmarks/README.md).
PEER_W=/tmp/peerx PEER_PACK=/tmp/peerx/pack PEER_PARTS=$ASSETS/peer_ckpt
peerx() { gguf_joined || return 1; mkdir -p $PEER_W
          if [ ! -f $PEER_W/peer_specforge_h200.json ] && [ -f benchmarks/results/peer_specforge_h200.json ] \
             && grep -q '"scale": "x10"' benchmarks/results/peer_specforge_h200.json; then
            cp benchmarks/results/peer_specforge_h200.json $PEER_W/; fi
          local resume=(); [ -f $PEER_W/peer_specforge_h200.json ] && resume=(--resume)
          # SpecForge stops itself right after the last checkpoint that lands before 555 s of the call (or at
          # 555 s), then its checkpoint is packed (281 MiB: under 1 s on the H100 of 2026-12-07) and the JSON
          # written, before the call's 585 s (a device command's limit is 600 s: call with timeout_s 600)
          local lim=${LIMIT:-585}
          capped "$lim" python3 benchmarks/bench_peer.py --scale x10 --gguf "$GGUF" --wheels .whl \
            --workdir $PEER_W/work --json $PEER_W/peer_specforge_h200.json --specforge-deadline $((lim - 30)) \
            --specforge-pack $PEER_PACK --specforge-parts $PEER_PARTS "${resume[@]}" "$@"
          local r=$?
          [ -n "${OUT:-}" ] && cp $PEER_W/peer_specforge_h200.json $PEER_PACK/*.manifest.json "$OUT"/ 2>/dev/null
          return $r; }
# parts_out PACK PART...: parts of a packed checkpoint back through $OUT, with the manifests (at most 4 of 15 MiB a
# call; what is still to fetch: python benchmarks/parts.py batches MANIFEST .assets/peer_ckpt|ref_ckpt)
parts_out() { local pack=$1 f; shift; [ -n "${OUT:-}" ] || return 1
              for f in "$@"; do cp "$pack/$f" "$OUT"/ || return 1; done
              cp "$pack"/*.manifest.json "$OUT"/; }
# the reference run's stretch (benchmarks/README.md, "The reference run's stretch"): the greedy and both sampled
# regenerations, the reference run alone online with int4 rounding (no cache of their features fits the disk), 3
# epochs over 2-3 sessions. Every call the same `stretch [ARGS]`; its JSON lives in /tmp/bstretch, seeded in a new
# session from the committed quality_reference_h200.json's "stretch" (bench_reference --stretch puts it there). The
# regenerations are read where the tree keeps them (a slim tree's calls get them back from the stash of a call
# that carried the whole tree: h200_assets.sh); the run's newest checkpoint is packed at every call's end into
# $STRETCH_PACK (stretchout brings it back), carried in as .assets/ref_ckpt/* (stashed into $STRETCH_PARTS)
STRETCH_W=/tmp/bstretch STRETCH_PACK=/tmp/bstretch/pack STRETCH_PARTS=$ASSETS/ref_ckpt
STRETCH_JSON=/tmp/bstretch/quality_reference_stretch_h200.json
stretch() { local q=benchmarks/assets/quality r; gguf_joined || return 1; mkdir -p $STRETCH_W
            if [ ! -f $q/sharegpt_sampled_t0.8_s2-00.jsonl.gz ]; then
              echo "run_h200.sh stretch: no sampled regenerations in $q: carry the whole tree in one call first" >&2
              return 1; fi
            [ -f $STRETCH_JSON ] || python3 -c 'import json, sys; s = json.load(open(sys.argv[1])).get("stretch")
if s: json.dump(s, open(sys.argv[2], "w"), indent=2)' benchmarks/results/quality_reference_h200.json $STRETCH_JSON
            local resume=(); [ -f $STRETCH_JSON ] && resume=(--resume)
            capped "${LIMIT:-570}" python3 benchmarks/bench_reference.py --workdir $STRETCH_W/work --gguf "$GGUF" \
              --json $STRETCH_JSON --train-data $q/sharegpt_whole-0*.jsonl.gz $q/sharegpt_sampled_t0.8_s1-0*.jsonl.gz \
              $q/sharegpt_sampled_t0.8_s2-0*.jsonl.gz --storage int4 --online-reference --epochs 3 \
              --online-compile on --eval-responses benchmarks/assets/peer --drop-caches \
              --skip all_bf16,all_seed1,all_noise,all_seqnorm,n2000,n8000 --pack-runs $STRETCH_PACK \
              --run-parts $STRETCH_PARTS --plot-dir $STRETCH_W/plots "${resume[@]}" "$@"
            r=$?  # a training process killed where it stood packs nothing: its newest checkpoint packed here
            [ -f $STRETCH_JSON ] && python3 benchmarks/bench_reference.py --json $STRETCH_JSON --workdir $STRETCH_W/work \
              --pack-runs $STRETCH_PACK --pack-only
            [ -n "${OUT:-}" ] && cp $STRETCH_JSON $STRETCH_PACK/*.manifest.json "$OUT"/ 2>/dev/null
            return $r; }
# the methods comparison (docs/dflash2.md): DFlash, DFlash 2 and each with the variable-prefix objective, DFlash and
# DFlash 2 also at seed 1, each on the reference run's data and recipe (bench_reference's defaults under --methods:
# the greedy and seed-1 sampled regenerations, int4, 2 epochs), ~6 runs of ~6-9 min over 2 sessions. Every call of
# every session the same `methods [ARGS]`; its JSON lives in $METHODS_W, seeded in a new session from the
# committed results/methods_h200.json (finished runs kept; a run a machine took back with it is trained again) and
# copied to $OUT after every call. The regenerations are read where the tree keeps them (carry the whole tree in a
# session's first call, as for the stretch)
METHODS_W=/tmp/bmethods METHODS_JSON=/tmp/bmethods/methods_h200.json
methods() { local r; gguf_joined || return 1; mkdir -p $METHODS_W
            if [ ! -f $METHODS_JSON ] && [ -f benchmarks/results/methods_h200.json ]; then
              cp benchmarks/results/methods_h200.json $METHODS_JSON; fi
            # a call cut before its JSON's first write recorded nothing to continue: start that workdir again
            local resume=(); if [ -f $METHODS_JSON ]; then resume=(--resume); else rm -rf $METHODS_W/work; fi
            capped "${LIMIT:-570}" python3 benchmarks/bench_reference.py --methods --workdir $METHODS_W/work \
              --gguf "$GGUF" --json $METHODS_JSON --drop-caches --plot-dir $METHODS_W/plots "${resume[@]}" "$@"
            r=$?
            [ -n "${OUT:-}" ] && [ -f $METHODS_JSON ] && cp $METHODS_JSON "$OUT"/
            return $r; }
smollm2step() { gguf_joined || return 1
                capped 560 python3 benchmarks/bench_smollm2_step.py --gguf "$GGUF" "$@"; }
storage4() { local stage=$1; shift
             if [ "$stage" = tau ]; then gguf_joined || return 1; set -- --gguf "$GGUF" --workdir /tmp/bs4 "$@"; fi
             capped 570 python3 benchmarks/bench_storage4.py --stage "$stage" "$@"; }
# the gpu-marked tests and bench_block_mask in groups that continue across the calls of a warm machine (gpu_check.py:
# exit 3 while groups are pending); ARGS go to gpu_check.py (--only GROUPS, --fresh)
gpu_tests() { local t; t=$(limit "$1"); shift
  gguf_joined && export DFLASH_SMOLLM2_GGUF=$GGUF  # the generate group decodes SmolLM2 from it (else it waits)
  timeout $((t + 30)) python3 benchmarks/gpu_check.py --budget "$t" --out "$LOGS" "$@"; }
# the object-store read rate where server and client do not share cores: the CPU figure's command with SeaweedFS
# (joined from the stashed parts of scripts/split_weed.sh) on one half of the physical cores and the client on the
# other, the CPU figure kept beside it in the JSON. ~6 min on the CPU machine's 2 cores (one each): a bound
storegpu() { weed_joined || return 1
             capped 540 python3 benchmarks/bench_store.py --variants --split-cores \
               --beside benchmarks/results/store_s3_cpu.json --out benchmarks/results/store_s3_gpu.json "$@"; }
flextiles() { capped 560 python3 benchmarks/bench_flex_tiles.py --out "${OUT:-/tmp}/flex_tiles_h200.json" "$@"; }  # no target, no GGUF
sweep_then_gpu_tests() { sweep "$1"; gpu_tests 120; }
quality_parts() { quality "$1" "${QPARTS[@]}"; }
# both NAME0 "CMD0 ARGS" NAME1 "CMD1 ARGS": two stages at once, GPU 0 and GPU 1, logs in $LOGS/NAME.log
both() {
  BENCH_NOTE="bench_$3 ran on the other GPU meanwhile" CUDA_VISIBLE_DEVICES=0 $2 >"$LOGS/$1.log" 2>&1 &
  local a=$!
  BENCH_NOTE="bench_$1 ran on the other GPU meanwhile" CUDA_VISIBLE_DEVICES=1 $4 >"$LOGS/$3.log" 2>&1 &
  local b=$!
  wait $a || rc=$?; wait $b || rc=$?
  tail -n 25 "$LOGS/$1.log" "$LOGS/$3.log"
}

stage=${1:-io}; shift || true
rc=0
case "$stage" in
  io) cache; extract || rc=$? ;;
  cache) cache || rc=$? ;;
  extract) extract 560 "$@" || rc=$? ;;
  train) train "$@" || rc=$? ;;   # e.g. --compare-wgrad-fusion --result-name h200_wgrad
  trainreal) trainreal "$@" || rc=$? ;;
  steptail) steptail || rc=$? ;;
  sweep) sweep || rc=$? ;;
  check) gpu_tests 560 "$@" || rc=$? ;;  # every call the same until it exits 0 (3: groups pending)
  quality) quality 560 "$@" || rc=$? ;;
  reference) reference "${LIMIT:-570}" "$@" || rc=$? ;;  # LIMIT: under what a session has left
  # train --shuffle-block N's effect on held-out tau: the reference run again with it (all_shuffle), the finished
  # runs kept (benchmarks/README.md, "The shuffle block's effect"); every call the same, N default 16
  shuffleeffect) reference "${LIMIT:-570}" "${REF_DATA[@]}" --shuffle-block "${1:-16}" || rc=$? ;;
  refpair) refpair "${LIMIT:-570}" ;;
  refone) refone "${LIMIT:-570}" "$@" || rc=$? ;;
  evaloverhead) evaloverhead || rc=$? ;;
  storage4) storage4 "$@" || rc=$? ;;
  smollm2step) smollm2step "$@" || rc=$? ;;
  peer) peer "$@" || rc=$? ;;
  peerx) peerx "$@" || rc=$? ;;   # 10x, every call of every session (ARGS: --stop-after sets|extract, --one-run)
  peerout) parts_out $PEER_PACK "$@" || rc=$? ;;
  stretch) stretch "$@" || rc=$? ;;  # every call of every session; LIMIT=<seconds> for a session's last
  methods) methods "$@" || rc=$? ;;  # every call of every session; LIMIT=<seconds> for a session's last
  stretchout) parts_out $STRETCH_PACK "$@" || rc=$? ;;
  stash) ;;                        # carry only: the GGUF / weed / checkpoint parts of this call stashed above
  flextiles) flextiles "$@" || rc=$? ;;
  storegpu) storegpu "$@" || rc=$? ;;
  pair1) cache; both extract "extract 410" train "train 410" ;;
  pair2) QPARTS=("$@"); both quality "quality_parts 540" sweep "sweep_then_gpu_tests 400" ;;
  pair3) both extract "extract 540" sweep "sweep 540" ;;
  pair4) QPARTS=("$@"); both quality "quality_parts 540" extract "extract 540" ;;
  *) echo "usage: $0 io|cache|extract ARGS|train|trainreal|steptail|sweep|check [ARGS]|quality PARTS [--resume]|reference ARGS|shuffleeffect [N]|refpair|refone fp8/bf16|evaloverhead|storage4 STAGE|smollm2step ARGS|peer ARGS|peerx ARGS|peerout PARTS|stretch ARGS|stretchout PARTS|methods ARGS|stash|flextiles ARGS|storegpu ARGS|pair1|pair2 PARTS|pair3|pair4 PARTS" >&2
     exit 2 ;;
esac
# only what this call wrote: $OUT brings back at most 8 files
[ -n "${OUT:-}" ] && find benchmarks/results /tmp/bq/quality_smollm2.json /tmp/bref/quality_reference_h200.json \
  /tmp/peer/peer_specforge_h200.json \
  -maxdepth 1 -newer "$START" \( -name '*_h200.json' -o -name '*_h200_*.json' -o -name '*_gpu.json' \
  -o -name 'quality_reference_*.png' \) \
  -exec cp {} "$OUT"/ \; 2>/dev/null
exit $rc
