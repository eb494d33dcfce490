"""Where the slot decoder's time goes (dflash.generate.slots), for the continuous backend's regeneration speed.

The first H200 run of whole-conversation regeneration on the slot engine reached 1,387 tok/s (1,024 ShareGPT
conversations, 512 slots, 2,048-token slots), far under the static decoder's first-turn rate: this probe times
each part on the real SmolLM2 target so the fix is measured, not guessed.

    python benchmarks/bench_slots.py --model DIR --data sharegpt_users.jsonl.gz --out slot_probe_h200.json

Parts (each appended to the JSON as it finishes, so a cut call keeps what ran):
  decode   one decode step at --slots rows: attention as SDPA with a mask or as a batched matmul, eager and
           compiled (torch.compile mode reduce-overhead / default), at kv_len buckets; median ms per step
  profile  the CUDA kernels of a few steps of the slowest and the fastest decode form (torch.profiler top rows)
  prefill  eager prefills of rows x ids shapes (a first turn, a later turn's new ids); ms per call
  engine   a bounded `dflash generate --backend continuous` run on real conversations: tok/s and the engine's
           counters line (decode/prefill split, slot occupancy)
  host     the engine's own bookkeeping per decode step (no model: its decoder replaced by one that answers at
           once with random tokens), 4,000 requests of 50-256 tokens; runs anywhere:
           python benchmarks/bench_slots.py --parts host --model none --data none --out /tmp/host.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(fn, *, n: int) -> float:
    """Median ms of n calls (each ends in a host copy, as the engine's steps do)."""
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append(1000 * (time.perf_counter() - t))
    return statistics.median(ts)


def decoder(model, *, slots: int, cache_len: int, bmm: bool, mode: str | None):
    """The engine's SlotDecoder; mode None: eager, "graphs": its step captured as CUDA graphs, else its
    compiled step in that torch.compile mode."""
    from dflash.generate.slots import SlotDecoder

    compiled = mode not in (None, "graphs")
    return SlotDecoder(model, slots=slots, cache_len=cache_len, compile=compiled, decode_bmm=bmm,
                       compile_mode=mode if compiled else "reduce-overhead", cuda_graphs=mode == "graphs")


def host_overhead(*, slots: int, cache_len: int, requests: int = 4000, results: int = 2000) -> dict:
    """Host ms per decode step of SlotEngine's bookkeeping alone (see the module docstring, part host)."""
    import random
    from unittest import mock

    from dflash.generate import slots as slots_mod

    class InstantDecoder:
        def __init__(self, model, *, slots, cache_len, **_):
            self.slots, self.cache_len, self.device = slots, cache_len, torch.device("cpu")

        def decode(self, tok, pos, *, kv_len=None):
            return torch.randint(10, 1000, (self.slots,))

        def prefill(self, slot_ids, ids, starts):
            return torch.randint(10, 1000, (len(slot_ids),))

    rng = random.Random(0)
    with mock.patch.object(slots_mod, "SlotDecoder", InstantDecoder):
        eng = slots_mod.SlotEngine(None, stop_ids=[0], slots=slots, cache_len=cache_len)
    for i in range(requests):
        eng.submit(f"r{i}", [rng.randint(10, 999) for _ in range(rng.randint(20, 400))], rng.randint(50, 256),
                   stream=i)
    t = time.perf_counter()
    for _ in range(results):
        key, _ = eng.next_result()
        eng.release(int(key[1:]))
    dt = time.perf_counter() - t
    c = eng.counters
    return {"seconds": round(dt, 3), "decode_steps": c["decode_steps"],
            "host_ms_per_step": round(1000 * dt / c["decode_steps"], 3),
            "occupancy": round(c["decode_rows"] / (c["decode_steps"] * slots), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, help="conversations for the engine part")
    ap.add_argument("--slots", type=int, default=512)
    ap.add_argument("--cache-len", type=int, default=2048)
    ap.add_argument("--parts", default="decode,profile,prefill,engine")
    ap.add_argument("--engine-seconds", type=int, default=150)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from dflash.target.load import load_target

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res: dict = {"bench": "bench_slots", "command": "python " + " ".join(sys.argv), "device":
                 torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__,
                 "slots": args.slots, "cache_len": args.cache_len}

    def save():
        pathlib.Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps(res)[-600:], flush=True)

    parts = args.parts.split(",")
    if "host" in parts:
        res["host"] = host_overhead(slots=args.slots, cache_len=args.cache_len)
        save()
        if parts == ["host"]:
            return
    model, _ = load_target(args.model, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    S, L = args.slots, args.cache_len
    tok = torch.randint(100, 1000, (S,), device=dev)
    pos = torch.randint(0, 200, (S,), device=dev)
    if "decode" in parts:
        res["decode_ms"] = {}
        # eager and graphs first: they need no compiler, so a probe under a short limit still times them
        forms = [("sdpa", "eager", (256, 1024, L)), ("bmm", "eager", (256, 1024, L)),
                 ("sdpa", "graphs", (256, 1024, L)), ("bmm", "graphs", (L,)),
                 ("bmm", "reduce-overhead", (512, L)), ("sdpa", "reduce-overhead", (L,)), ("bmm", "default", (L,))]
        for attn, mode, lens in forms:
            if dev == "cpu" and mode != "eager":  # inductor's CPU compile of the whole step: minutes, not the question
                continue
            lens = sorted({min(kv, L) for kv in lens})
            dec = decoder(model, slots=S, cache_len=L, bmm=attn == "bmm", mode=None if mode == "eager" else mode)
            for kv in lens:
                key = f"{attn}/{mode}/kv{kv}"
                try:
                    t = time.perf_counter()
                    dec.decode(tok, pos, kv_len=kv).tolist()
                    first = time.perf_counter() - t
                    if mode == "graphs" and not dec.cuda_graphs:  # the capture failed: eager was timed
                        raise RuntimeError("capturing the decode step failed (see the warning above)")
                    if mode not in ("eager", "graphs") and not dec._compiled:  # fell back to its eager step
                        raise RuntimeError("compiling the decode step failed (see the warning above)")
                    for _ in range(3):
                        dec.decode(tok, pos, kv_len=kv).tolist()
                    ms = timed(lambda: dec.decode(tok, pos, kv_len=kv).tolist(), n=20)
                    res["decode_ms"][key] = {"ms": round(ms, 3), "first_call_s": round(first, 2),
                                             "tok_s_all_slots_busy": round(S / ms * 1000)}
                except Exception as e:  # noqa: BLE001 - a probe: record and go on
                    res["decode_ms"][key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                save()
            del dec
            torch.cuda.empty_cache()
        from torch._dynamo.utils import counters

        res["dynamo_counters"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break", "recompiles")}
        save()
    if "profile" in parts:
        from torch.profiler import ProfilerActivity, profile

        res["profile"] = {}
        for attn in ("sdpa", "bmm"):
            dec = decoder(model, slots=S, cache_len=L, bmm=attn == "bmm", mode=None)
            dec.decode(tok, pos, kv_len=L).tolist()
            with profile(activities=[ProfilerActivity.CUDA if dev == "cuda" else ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    dec.decode(tok, pos, kv_len=L).tolist()
            us = (lambda e: e.device_time_total) if dev == "cuda" else (lambda e: e.self_cpu_time_total)
            rows = sorted(prof.key_averages(), key=lambda e: -us(e))[:8]
            res["profile"][f"{attn}/eager/kv{L}"] = [
                {"name": e.key[:90], "ms_per_step": round(us(e) / 3000, 3), "calls": e.count // 3} for e in rows]
            del dec
            save()
    if "prefill" in parts:
        from dflash.generate.slots import SlotDecoder

        dec = SlotDecoder(model, slots=S, cache_len=L, compile=False)
        res["prefill_ms"] = {}
        for rows, n, start in ((8, 2000, 0), (64, 256, 0), (256, 48, 600), (32, 48, 600)):
            rows, n = min(rows, S), min(n, L)
            start = min(start, L - n)
            ids = [[int(x) for x in torch.randint(100, 1000, (n,))] for _ in range(rows)]
            f = lambda: dec.prefill(list(range(rows)), ids, [start] * rows).tolist()  # noqa: E731
            f()
            res["prefill_ms"][f"{rows}x{n}@{start}"] = round(timed(f, n=5), 3)
            save()
        del dec
    if "engine" in parts:
        from dflash.generate.run import RegenerateConfig, regenerate

        out = pathlib.Path("/tmp/bench_slots_engine.jsonl.gz")
        lines: list[str] = []
        cfg = RegenerateConfig(model=args.model, output=str(out), data=(args.data,), turns="all", max_new_tokens=256,
                               max_length=L, batch_size=S, chunk_conversations=64, backend="continuous",
                               window=S, limit=3 * S, overwrite=True)  # window S: later chunks wait, so the
        # time limit can hold them back (chunks admitted at once all run to the end)
        t = time.perf_counter()
        st = regenerate(cfg, progress=False, echo=lines.append, stop_after=args.engine_seconds)
        dt = time.perf_counter() - t
        res["engine"] = {"seconds": round(dt, 1), "turns": st.turns, "response_tokens": st.response_tokens,
                         "tok_s_incl_compile": round(st.response_tokens / dt), "complete": st.complete,
                         "log": lines[-3:]}
        save()


if __name__ == "__main__":
    main()
