#!/usr/bin/env bash
# Regeneration and the second-wave GPU checks on the H200, spread over device calls of at most 10 minutes on one
# warm machine. Inputs travel in .assets/ (git-ignored): smollm2.gguf.part-a ... -e, one per call
# (scripts/split_gguf.sh; benchmarks/h200_assets.sh stashes them on the machine), sharegpt_users.jsonl.gz (the
# package's 17,392 conversations, user turns kept, assistant turns blanked to ".":
# they are regenerated), and the prompt files of scripts/make_quality_assets.py. Stages:
#   stash       (carry .whl + a part) install wheels, keep the part; the fused-CE and fused-target GPU tests,
#               bench_fused_ce (27B drafter head)
#   firstturns  (carry the last GGUF part + data) the SmolLM2 folder; the GPU generate test; bench_eval_overhead; the first
#               user turn of every ShareGPT conversation regenerated (--turns first)
#   bench       (carry the last GGUF part + data) the SmolLM2 folder, bench_generate, whole-conversation regeneration
#   regen       continue the whole-conversation regeneration
#   whole       (carry the last GGUF part + data) the SmolLM2 folder, bench_slots' decode forms -> slot_probe_h200.json, then
#               the whole-conversation regeneration on the continuous backend (WHOLE) with the fastest form
#               (2026-12-01: eager sdpa, 8-9.5K tok/s; 2026-12-02: bmm replayed as CUDA graphs, 12.6-13.0K tok/s,
#               after the fp32 GPU test of the captured step passed; the compiled step did not compile within a call)
#   wholemore   continue WHOLE (the model folder must still be on the warm machine, else carry a GGUF part again)
#   wholestatic the same regeneration on round-by-round static batches in chunks of 2,048 conversations (the
#               fallback when slot_probe_h200.json shows the slot decoder slow)
#   sampled SEED [TEMP]  (carry the last GGUF part + data, or on a machine that ran a stage above) the same whole
#               conversations sampled at temperature TEMP (0.8) with seed SEED on the slot decoder (its bmm graphs;
#               the GPU test of the sampled graph step first, then bench_sampling_diversity.py on the 244 held-out
#               prompts): more of the target's text from the same prompts (issue 14). Rerun the same command to
#               continue. Output sharegpt_sampled_t<TEMP>_s<SEED>.
# Regenerated conversations come back packed as text (benchmarks/pack_regen.py), results as JSON, both in $OUT.
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
. benchmarks/h200_assets.sh
stash_parts
export DFLASH_HOME=$ASSETS           # the smollm2_dir test fixture finds the converted folder there
MODEL=$ASSETS/smollm2-135m-instruct
REGEN=$ASSETS/regen/sharegpt_regen.jsonl.gz
FIRST=$ASSETS/regen/sharegpt_first.jsonl.gz
WHOLE=$ASSETS/regen/sharegpt_whole.jsonl.gz
LOGS=${OUT:-/tmp}
T0=$(date +%s)
left() { echo $(( ${1:-590} - ($(date +%s) - T0) )); }

model() {
  [ -f "$MODEL/dflash-asset.json" ] && return 0
  gguf_joined || return 1
  python3 -c "from dflash.target.assets import convert_gguf_to_hf as c; print(c('$GGUF', '$MODEL'))" \
    2>&1 | tail -n 1
}
generate() {  # $1: seconds, $2: output, rest: options
  local t=$1 out=$2; shift 2
  cp -n .assets/sharegpt_users.jsonl.gz "$ASSETS/" 2>/dev/null
  timeout "$t" python3 -m cli.main generate --model "$MODEL" --data "$ASSETS/sharegpt_users.jsonl.gz" \
    --output "$out" --batch-size 512 --stop-after $(( t - 40 )) "$@" 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" \
    > /tmp/generate.log
  grep -v "^generate: " /tmp/generate.log | tail -n 15
  grep "^generate: " /tmp/generate.log | tail -n 1   # the last progress line: turns, rates
  python3 benchmarks/pack_regen.py "$out" "$LOGS" --prefix "$(basename "$out" .jsonl.gz)"
}

whole() {  # the continuous backend on the slot decoder form whole chose (no choice recorded: the defaults, bmm graphs)
  local attn step
  read -r attn step < "$ASSETS/slot_choice" 2>/dev/null || { attn=bmm; step=graphs; }
  DFLASH_SLOT_ATTENTION=$attn DFLASH_SLOT_STEP=$step generate "$(left "${WHOLE_SECONDS:-585}")" "$WHOLE" --backend continuous \
    --turns all --max-new-tokens 256 --max-length 2048 --chunk-conversations 128 --window 1024
}

stage=${1:-}
rc=0
case "$stage" in
  stash)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || exit 1
    for t in tests/gpu/test_fused_ce_gpu.py tests/gpu/test_target_fused_gpu.py; do
      timeout 150 python3 -m pytest -q -p no:cacheprovider -W ignore::Warning "$t" 2>&1 | tail -n 8
    done
    timeout "$(left 400)" python3 benchmarks/bench_fused_ce.py 2>&1 | tail -n 3 > "$LOGS/fused_ce_h200.log"
    cat "$LOGS/fused_ce_h200.log" ;;
  firstturns)
    model || exit 1
    timeout 120 python3 -m pytest -q -p no:cacheprovider -W ignore::Warning -m gpu tests/gpu/test_generate_gpu.py \
      2>&1 | tail -n 5
    if [ -f benchmarks/bench_eval_overhead.py ]; then
      timeout 300 python3 benchmarks/bench_eval_overhead.py --gguf-parts "$GGUF" --workdir "$ASSETS/eo" --json "$LOGS/eval_overhead_h200.json" 2>&1 \
        | tr '\r' '\n' | grep -v "it/s\]$" | tail -n 25 || rc=$?
    fi
    generate "$(left 585)" "$FIRST" --turns first --max-new-tokens 256 --max-length 1024 \
      --chunk-conversations 2048 || rc=$? ;;
  bench)
    model || exit 1
    timeout 300 python3 benchmarks/bench_generate.py --model "$MODEL" --data .assets/sharegpt_users.jsonl.gz \
      2>&1 | tail -n 30 || rc=$?
    cp benchmarks/results/generate_h200.json "$LOGS/" 2>/dev/null
    generate "$(left 585)" "$REGEN" --turns all --max-new-tokens 256 --max-length 2048 --chunk-conversations 512 \
      || rc=$? ;;
  regen) generate "$(left 585)" "$REGEN" --turns all --max-new-tokens 256 --max-length 2048 \
           --chunk-conversations 512 || rc=$? ;;
  whole)  # the slot decoder: probe its decode forms (benchmarks/bench_slots.py), then regenerate on the fastest
    model || exit 1
    cp -n .assets/sharegpt_users.jsonl.gz "$ASSETS/" 2>/dev/null
    # the graph-captured step may serve only if it reproduces HF generate (fp32, tests/gpu): a wrong capture would
    # write wrong training data silently
    timeout 120 python3 -m pytest -q -p no:cacheprovider -W ignore::Warning -m gpu tests/gpu/test_generate_gpu.py \
      -k graphs 2>&1 | tail -n 3
    export SLOT_GRAPHS_OK=$([ "${PIPESTATUS[0]}" = 0 ] && echo 1 || echo 0)
    # 110 s: the eager and graph forms finish in ~30 s; a compiled form only counts if it compiles in time
    timeout 110 python3 benchmarks/bench_slots.py --model "$MODEL" --data "$ASSETS/sharegpt_users.jsonl.gz" \
      --parts decode --out "$LOGS/slot_probe_h200.json" 2>&1 | grep -v "Loading weights" | tail -n 1 | cut -c1-300
    python3 - "$LOGS/slot_probe_h200.json" > "$ASSETS/slot_choice" <<'PY' || echo "sdpa eager" > "$ASSETS/slot_choice"
import json, os, sys
d = json.load(open(sys.argv[1]))["decode_ms"]
ok = {k: v["ms"] for k, v in d.items() if "ms" in v and k.endswith("kv2048")
      and ("/graphs/" not in k or os.environ.get("SLOT_GRAPHS_OK") == "1")}
attn, mode, _ = min(ok, key=ok.get).split("/")
print(attn, mode if mode in ("eager", "graphs") else "compiled")
PY
    echo "slot decoder: $(cat "$ASSETS/slot_choice") (attention, step)"
    whole || rc=$? ;;
  wholemore) model || exit 1
    whole || rc=$? ;;
  wholestatic) model || exit 1  # the fallback if bench_slots shows the slot decoder slow: round-by-round
    # static batches; large chunks keep each round's batches full (944 tok/s at 256 conversations per chunk)
    generate "$(left 585)" "$ASSETS/regen/sharegpt_whole_static.jsonl.gz" --backend static --turns all \
      --max-new-tokens 256 --max-length 2048 --chunk-conversations 2048 || rc=$? ;;
  sampled) model || exit 1
    seed=${2:?sampled SEED [TEMP]} temp=${3:-0.8}
    if [ ! -f "$ASSETS/sampled_graphs_ok" ]; then  # a wrong capture would write wrong training data silently
      timeout 120 python3 -m pytest -q -p no:cacheprovider -W ignore::Warning -m gpu tests/gpu/test_generate_gpu.py \
        -k sampled 2>&1 | tail -n 3
      [ "${PIPESTATUS[0]}" = 0 ] && touch "$ASSETS/sampled_graphs_ok"
    fi
    step=$([ -f "$ASSETS/sampled_graphs_ok" ] && echo graphs || echo eager)
    if [ ! -f "$ASSETS/sampling_diversity_done" ]; then  # how much new text a sampled pass adds (~1 min)
      DFLASH_SLOT_STEP=$step timeout 150 python3 benchmarks/bench_sampling_diversity.py --model "$MODEL" \
        --limit 244 --max-new-tokens 256 --temperature "$temp" --batch-size 256 2>&1 | grep -v "^{" | tail -n 9 \
        && cp benchmarks/results/sampling_diversity_h200.json "$LOGS/" && touch "$ASSETS/sampling_diversity_done"
    fi
    DFLASH_SLOT_ATTENTION=bmm DFLASH_SLOT_STEP=$step generate "$(left 585)" \
      "$ASSETS/regen/sharegpt_sampled_t${temp}_s${seed}.jsonl.gz" --backend continuous --temperature "$temp" \
      --seed "$seed" --turns all --max-new-tokens 256 --max-length 2048 --chunk-conversations 128 --window 1024 \
      || rc=$? ;;
  *) echo "usage: $0 stash|firstturns|bench|regen|whole|wholemore|wholestatic|sampled SEED [TEMP]" >&2; exit 2 ;;
esac
exit $rc
