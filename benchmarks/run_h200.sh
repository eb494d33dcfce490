#!/usr/bin/env bash
# The GPU measurements, sized so that each stage fits one device call (10 min). Run from the repo root on the
# H200 machine with the carried wheels in .whl/ (bash scripts/fetch_gpu_wheels.sh: zarr and its codecs, crc32c,
# msgspec, gguf, FLA, SpecForge's extras) and, for the SmolLM2 stages, the GGUF parts of scripts/split_gguf.sh and
# the prompt files of scripts/make_quality_assets.py in .assets/ (both git-ignored: make them in every new checkout).
# LIMIT=<seconds> caps every stage's own time limit: set it under the call's timeout_s (and, in a session's last
# call, under the device time left) so the bench stops itself and what it wrote comes back through $OUT (a call
# killed from outside returns nothing: 2026-12-04's extract --compare-compile-layers at a 530 s call limit).
#   bash benchmarks/run_h200.sh io      # bench_cache (~4 min: 3 interleaved cold reads per variant) + bench_extract
#       600K tokens (~7 min; together past one call's 10 minutes: `cache` alone, then `extract`)
#   bash benchmarks/run_h200.sh cache   # bench_cache alone (issue 20's read ratios, ~4 min)
#   bash benchmarks/run_h200.sh extract [ARGS]  # bench_extract 600K tokens alone (~7 min: ~5 timed, 1 untimed
#       warm-up pass); ARGS go to bench_extract, e.g. --storage fp8 --compare-compile (issue 20: compiled vs eager)
#       or --storage fp8 --peer-tokens 0 --compare-compile-layers (decoder layers compiled whole vs the chains:
#       the fp8 run is forward-bound, 11,853 tok/s at 0.98 of forward-only on 2026-12-04; ~1-2 min more)
#   bash benchmarks/run_h200.sh train   # bench_train, compiled vs eager elementwise + kernel profile (~5 min)
#   bash benchmarks/run_h200.sh trainreal  # bench_train_real: real ShareGPT lengths and equal 2,048-token
#       sequences from a disk cache, 27B drafter shape (issue 20's train_real_lengths_h200.json, ~6-7 min)
#   bash benchmarks/run_h200.sh steptail  # bench_step_tail: normalise + clip + AdamW on the 27B drafter's 1.73B
#       parameters, three passes over the gradients vs one divisor folded into the fused AdamW (~1 min)
#   bash benchmarks/run_h200.sh sweep   # bench_sweep --synthetic (27B features, 4 drafters)
#   bash benchmarks/run_h200.sh check   # the gpu-marked tests + bench_block_mask (~3 min)
#   bash benchmarks/run_h200.sh quality GGUF_PART... [--resume]   # bench_quality, 2000 prompts, 400 steps, 3 seeds
#       (SmolLM2 target from scripts/split_gguf.sh parts; a call cut short at 10 minutes is continued by the
#       same command with --resume on the still-warm machine)
#   bash benchmarks/run_h200.sh reference [ARGS] [--resume]   # bench_reference on the committed data
#       (benchmarks/assets/quality: every ShareGPT conversation regenerated whole on the H200, the eval prompt files;
#       the target from the GGUF parts stashed by this and earlier calls), fp8 caches (a bf16 cache of all the data
#       does not fit the 64 GiB disk: --skip all_bf16 --drop-caches, or --bf16-online), held-out tau every 500
#       steps; every call after the first adds --resume; a training cut at the limit continues from its last
#       checkpoint. A new session (the tracked tree is ~44 MB of the 64 MiB a call carries): carry .whl in a first
#       call, then the GGUF parts a-d one per call (`. benchmarks/h200_assets.sh && stash_parts`, ~0.3 s each), and
#       part-e in the call that starts the run, e.g.
#         reference --skip all_bf16,all_noise,all_seed1,all_seqnorm,n8000 --drop-caches
#       then `reference ... --resume` while the machine stays warm. The committed quality_reference_h200.json is the
#       2026-12-03 run on the greedy and the seed-1 sampled regeneration (33.4M tokens: 53 GB as int4, 99 GB as fp8,
#       so int4 is the storage that fits): all_int4, n2000 and n8000 done; a later session's first --resume call
#       seeds /tmp/bref from it and continues it with the same data and the committed eval responses. all_seed1
#       finished 2026-12-04 (refpair, GPU 1). Still to run (each 4,088 steps; ~4 min of set-up first):
#         feature noise (~0.138 s a step, ~10 min + set-up):
#           reference --train-data benchmarks/assets/quality/sharegpt_whole-0*.jsonl.gz
#             benchmarks/assets/quality/sharegpt_sampled_t0.8_s1-0*.jsonl.gz --storage int4 --epochs 2
#             --eval-responses benchmarks/assets/peer --skip all_bf16,all_seqnorm --drop-caches --resume
#         fp8 vs bf16 at that point, both online from the token stream of a one-tap int4 cache of the same data
#         (extracted in 160 s), the live target's features rounded as an fp8 / bf16 cache would store them. On one
#         GPU as one sweep group (--parallel-runs 2: one target forward per step for both) a group step took
#         0.36-0.40 s (2026-12-04; 0.33-0.39 s later that day with compiled target layers and the drafter's 64 x 64
#         flex tiles), ~26 min for the pair, more than a session's 30 device-minutes with the set-up; on
#         nvidia-h200-x2 each alone on its own GPU (refpair) when that kind is lent, else one per session on one
#         GPU (refone fp8, refone bf16). all_bf16 finished 2026-12-04 (refone bf16: two calls, ~2 min of set-up,
#         then 0.19-0.27 s a step; ~23 min of device time with the machine start and the asset calls): refone fp8
#         is what is left. The group on one GPU, as tried:
#           reference ... --compare-online --also-storages fp8 --skip all_noise,all_seed1,all_seqnorm
#             --parallel-runs 2 --resume
#       The session's last call: LIMIT=<seconds> under the device time left, so the bench is stopped (its runs'
#       curves so far kept in the JSON as partial_curves) and the JSON copied out before the machine is taken.
#       A call cut at its limit resumes each run from its last checkpoint (--save-every 100), but only on the same
#       warm machine: the device goes back ~30 s after a call, so chain the calls without a pause.
#       The runs of 2026-12-02 (results/quality_reference_first12930_h200.json: greedy only, fp8, 6 epochs) are
#       not continued: the data changed (the training files' sha256 is a run's identity).
#   bash benchmarks/run_h200.sh refpair   # on nvidia-h200-x2: fp8 vs bf16 at the reference point, each online
#       alone on its own GPU from the committed JSON (~3.5 min of set-up, then 4,088 steps at ~0.27 s: ~22 min);
#       every call the same command (LIMIT=<seconds> for the session's last), the two JSONs merged here with
#       bench_reference.py --merge (see refpair below). 2026-12-04 its first form (the fp8 + bf16 group on GPU 0,
#       seed 1 then noise on GPU 1) finished all_seed1 before the machine was taken back
#   bash benchmarks/run_h200.sh refone fp8|bf16   # one half of refpair alone on one GPU, a session each (~20 min;
#       see refone below): the way to fp8 vs bf16 at the reference point while only one H200 is lent
#   bash benchmarks/run_h200.sh flextiles [ARGS]   # probe_flex_tiles: flex attention tile options on the drafter's
#       block layout, the SmolLM2 and 27B drafters' heads, and hd256 on request (~8 min for all variants;
#       max-autotune alone takes ~4 min a shape). --shapes 27b: the 27B drafter, 2026-12-04 (flex_tiles_27b_h200.json)
#   bash benchmarks/run_h200.sh storage4 STAGE [ARGS]   # bench_storage4 --stage extract|train (~6 min each, no
#       target needed) or tau (the SmolLM2 target from the stashed parts, the committed data)
#   bash benchmarks/run_h200.sh peer [ARGS]   # bench_peer (issue 15): SpecForge's DFlash trainer and dflash side by
#       side, the target from the stashed GGUF parts; SpecForge's extra wheels (yunchang, datasets, dill,
#       multiprocess, pydantic: benchmarks/peer/env.py WHEELS) go in .whl with the others; the peer snapshots travel
#       in the git-ignored shared/peers/ (mkdir -p shared/peers && cp ../shared/peers/*.tar.gz shared/peers/; carry
#       `shared`; only the checkout's own shared/ travels, not ../shared). After the three GGUF parts are stashed
#       (a call carrying .whl, then parts a-d one per call), four calls on one warm machine (2026-12-02: a-f ~6 min with
#       3 dflash seeds, ~4.5 now that the eval responses are committed, ~6.5 expected with the 6-epoch dflash run
#       of --dflash-time-epochs (876 steps at ~0.1 s: the time ratio's run), ~8.5 with the four --dflash-variants
#       runs (token, sequence normalization; SpecForge's anchor bound, full_blocks; its 8-sequence steps,
#       step_samples: ~30 s each; a call cut at its limit: --resume --stop-after dflash again); a SpecForge
#       run of 2 epochs of --train-prompts 1200 took 301 s, so one per call (--specforge-seeds 2 by default); h-i ~5.5 min):
#         peer --stop-after dflash (carrying part-e and shared);  peer --resume --stop-after specforge (twice);
#         peer --resume
#   bash benchmarks/run_h200.sh smollm2step [ARGS]   # bench_smollm2_step: the SmolLM2 drafter's step cached and
#       online (fp8-rounded), alone with a profile, two at once, and fp8 + bf16 online as one shared group (~7-8
#       min with the stashed GGUF, near a call's limit; what bench_reference --parallel-runs 2 gains and where an
#       online step's time goes). Before the shared fp8 vs bf16 reference runs, the short form (~5 min):
#         smollm2step --modes online_fp8,online_bf16 --pairs ""
#       The online step alone is host-bound on the eager target's kernel launches (2026-12-04: 2,867 launches,
#       GPU busy 172 ms of 0.27-0.37 s a step: smollm2_step_online*_h200.json); TrainConfig.online_compile runs
#       the target's layers compiled (~3 min with the stashed GGUF):
#         smollm2step --modes online_fp8,online_fp8_compiled --pairs "" --shared "" --steps 60
#           --conversations 1000 --json $OUT/smollm2_step_online_compiled_h200.json
#       2026-12-04: 0.230 vs 0.245 s a step (x1.06; 894 vs 2,854 launches, GPU busy 146 vs 164 ms), so REF_DATA
#       passes --online-compile on; TrainConfig's default stays off (a 6% gain, timed on SmolLM2's layers only).
#       The shared fp8 + bf16 group on one GPU (0.36-0.40 s a step before that and before the drafter's 64 x 64
#       flex forward tiles: ~18 ms less a step, results/flex_tiles_h200.json) is to be timed again before it is
#       tried in one session: ~22 min of 4,088 steps need <= 0.32 s a step.
#   bash benchmarks/run_h200.sh evaloverhead   # bench_eval_overhead on the reference run's 8K cache (~4 min)
# On a 2-GPU machine, two stages share one call, one GPU each (machine_info records it in "note"):
#   bash benchmarks/run_h200.sh pair1   # io on GPU 0 (bench_cache alone first) || train on GPU 1
#   bash benchmarks/run_h200.sh pair2 GGUF_PART...   # quality on GPU 0 || sweep on GPU 1, then the GPU tests
#   bash benchmarks/run_h200.sh pair3   # extract on GPU 0 || sweep on GPU 1
#   bash benchmarks/run_h200.sh pair4 GGUF_PART...   # quality on GPU 0 || extract on GPU 1 (then `quality PARTS
#       --resume` calls finish quality on GPU 0: the extract rerun costs no device time of its own)
# Results land in benchmarks/results/*_h200.json and, with logs, are copied to $OUT when set.
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
capped() { local t=$1; shift; if [ -n "${LIMIT:-}" ] && [ "$LIMIT" -lt "$t" ]; then t=$LIMIT; fi
           timeout "$t" "$@"; }
cache() { capped 330 python3 benchmarks/bench_cache.py --tokens 200000 --drop-caches --threads 16 --reps 3 \
            --cache-threads 32,64 --result-name h200
          rm -rf /tmp/dflash_bench_cache; }
extract() { capped "${1:-410}" python3 benchmarks/bench_extract.py --tokens 600000 --peer-tokens 100000 --fla-conv \
              "${@:2}"; }
train() { capped "${1:-560}" python3 benchmarks/bench_train.py --compare-compile --profile-steps 2; }
sweep() { capped "${1:-560}" python3 benchmarks/bench_sweep.py --synthetic; }
trainreal() { capped "${1:-560}" python3 benchmarks/bench_train_real.py; }
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
smollm2step() { gguf_joined || return 1
                capped 560 python3 benchmarks/bench_smollm2_step.py --gguf "$GGUF" "$@"; }
storage4() { local stage=$1; shift
             if [ "$stage" = tau ]; then gguf_joined || return 1; set -- --gguf "$GGUF" --workdir /tmp/bs4 "$@"; fi
             capped 570 python3 benchmarks/bench_storage4.py --stage "$stage" "$@"; }
gpu_tests() { capped "${1:-420}" python3 -m pytest -q -p no:cacheprovider -W ignore::Warning -m gpu tests/gpu \
  tests/unit/test_attention_tiles.py tests/unit/test_drafter_model.py; }  # named files: no hypothesis there
block_mask() { capped "${1:-200}" python3 benchmarks/bench_block_mask.py; }
flextiles() { capped 560 python3 benchmarks/probe_flex_tiles.py --out "${OUT:-/tmp}/flex_tiles_h200.json" "$@"; }  # no target, no GGUF
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
  train) train || rc=$? ;;
  trainreal) trainreal || rc=$? ;;
  steptail) steptail || rc=$? ;;
  sweep) sweep || rc=$? ;;
  check) gpu_tests || rc=$?; block_mask || rc=$? ;;
  quality) quality 560 "$@" || rc=$? ;;
  reference) reference "${LIMIT:-570}" "$@" || rc=$? ;;  # LIMIT: under what a session has left
  refpair) refpair "${LIMIT:-570}" ;;
  refone) refone "${LIMIT:-570}" "$@" || rc=$? ;;
  evaloverhead) evaloverhead || rc=$? ;;
  storage4) storage4 "$@" || rc=$? ;;
  smollm2step) smollm2step "$@" || rc=$? ;;
  peer) peer "$@" || rc=$? ;;
  flextiles) flextiles "$@" || rc=$? ;;
  pair1) cache; both extract "extract 410" train "train 410" ;;
  pair2) QPARTS=("$@"); both quality "quality_parts 540" sweep "sweep_then_gpu_tests 400" ;;
  pair3) both extract "extract 540" sweep "sweep 540" ;;
  pair4) QPARTS=("$@"); both quality "quality_parts 540" extract "extract 540" ;;
  *) echo "usage: $0 io|cache|extract ARGS|train|trainreal|steptail|sweep|check|quality PARTS [--resume]|reference ARGS|refpair|refone fp8/bf16|evaloverhead|storage4 STAGE|smollm2step ARGS|peer ARGS|flextiles ARGS|pair1|pair2 PARTS|pair3|pair4 PARTS" >&2
     exit 2 ;;
esac
# only what this call wrote: $OUT brings back at most 8 files
[ -n "${OUT:-}" ] && find benchmarks/results /tmp/bq/quality_smollm2.json /tmp/bref/quality_reference_h200.json \
  /tmp/peer/peer_specforge_h200.json \
  -maxdepth 1 -newer "$START" \( -name '*_h200.json' -o -name 'quality_reference_*.png' \) \
  -exec cp {} "$OUT"/ \; 2>/dev/null
exit $rc
