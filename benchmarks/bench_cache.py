"""Cache write/read throughput against the same bytes as one raw file and as one torch.save file per sample.

Writes a cache of realistic shape (ShareGPT-like sample lengths: lognormal around ~600 tokens, capped at
4096), then in the same run the same hidden bytes as one plain sequential file and as per-sample .pt files
(the peers' layout). Reads are cold where possible (drop_caches as root, else posix_fadvise DONTNEED) and go
through CacheReader.read_many, the loader's path. Prints a table; the last stdout line is the result JSON,
also written to benchmarks/results/cache_<name>.json. Needs only numpy, torch, crc32c (and zarr installed).

Read baselines over the same bytes: the raw file read by one thread (8 MiB reads) and by --threads threads
(the file cut into that many contiguous ranges, each read sequentially by its own thread and fd:
read_ratio_vs_raw_threaded), and the per-sample files loaded by --threads threads. With --reps R every cold read
runs R times, interleaved (raw, raw threaded, cache, per-sample, ...), and the ratios are of median seconds:
cold reads on shared or virtual disks vary run to run (on the 2-core dev box, 0.6-1.8 GB/s for the same cache
read). --cache-threads 16,32 also times the cache read at those reader thread counts (same reps). Before the
reads the three bf16 layouts are written again, interleaved sample by sample (untimed), so none reads faster for
having been written last (rewrite_interleaved; --no-fair-age reads them as the timed writes left them).

    python benchmarks/bench_cache.py --tokens 30000 --result-name cpu
    python benchmarks/bench_cache.py --tokens 200000 --drop-caches --threads 16 --reps 3 --cache-threads 32,64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common import drop_page_cache, shape_fingerprint  # noqa: E402
from dflash.cache import CacheReader, CacheWriter, Fingerprint, PackedBuffers  # noqa: E402
from dflash.cache.format import DEFAULT_BLOCK_BYTES, DEFAULT_CHUNK_BYTES  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/tmp/dflash_bench_cache", help="scratch directory (deleted first)")
    p.add_argument("--taps", type=int, default=5)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--tokens", type=int, default=30_000, help="total tokens of the bf16 cache")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drop-caches", action="store_true", help="cold reads: drop the page cache (or fadvise)")
    p.add_argument("--threads", type=int, default=8, help="reader threads of the cache, threaded raw and "
                   "per-sample reads (I/O bound: more than cores helps)")
    p.add_argument("--reps", type=int, default=1, help="cold reads per variant, interleaved; ratios of medians")
    p.add_argument("--no-fair-age", dest="fair_age", action="store_false",
                   help="read the files as the timed writes left them (cache first, then raw, then per-sample) "
                        "instead of rewriting the three interleaved, sample by sample, before the reads")
    p.add_argument("--cache-threads", default="", help="comma-separated extra reader thread counts for the cache "
                   "read (read_cache_threads_N)")
    p.add_argument("--batch-tokens", type=int, default=65536, help="tokens per read_many call")
    p.add_argument("--shard-tokens", type=int, default=1 << 16)
    p.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    p.add_argument("--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES, help="CacheWriter's streamed block per tap")
    p.add_argument("--fp8-fraction", type=float, default=0.25,
                   help="fp8 and int4 cache sizes relative to bf16 (bytes/token, and an int4 read)")
    p.add_argument("--result-name", default="cpu")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--results-dir", default=os.path.join(ROOT, "benchmarks", "results"),
                   help="folder of the result JSON")
    return p.parse_args(argv)


def sample_lengths(rng: np.random.Generator, total: int) -> np.ndarray:
    out, s = [], 0
    while s < total:
        L = int(min(4096, max(16, rng.lognormal(np.log(600), 0.8))))
        L = min(L, total - s) if total - s >= 16 else L
        out.append(L)
        s += L
    return np.array(out, np.int64)


def fingerprint(args, storage: str) -> Fingerprint:
    return shape_fingerprint(storage, hidden=args.hidden, taps=tuple(range(1, 2 * args.taps, 2)), target="bench")


def all_files(*dirs: str) -> list[str]:
    return [os.path.join(r, f) for d in dirs for r, _, fs in os.walk(d) for f in fs]


def make_cold(dirs: list[str], want: bool) -> str:
    return drop_page_cache(*dirs) if want else "warm"

def sample_rows(lengths, pool):
    """(i, L, rows of sample i) for every sample: consecutive windows of the random pool, wrapping around."""
    off = 0
    for i, L in enumerate(lengths):
        a = off % (len(pool) - 4096)
        yield i, int(L), slice(a, a + L)
        off += L


def cache_append(w, i, L, rows, pool, pool_scales=None, pool_groups=None) -> None:
    w.append(sample_ids=np.array([i]), lengths=np.array([L]), input_ids=np.zeros(L, np.int32),
             loss_mask=np.ones(L, np.uint8), hidden=pool[rows],
             scales=None if pool_scales is None else pool_scales[rows],
             group_scales=None if pool_groups is None else pool_groups[rows])


def cache_writer(path, args, storage):
    return CacheWriter(path, fingerprint(args, storage), shard_tokens=args.shard_tokens, chunk_bytes=args.chunk_bytes,
                       block_bytes=args.block_bytes)


def per_sample_save(d, i, L, rows, pool) -> None:
    torch.save({"hidden": pool[rows].view(torch.bfloat16).clone(), "input_ids": torch.zeros(L, dtype=torch.int32),
                "loss_mask": torch.ones(L, dtype=torch.uint8)}, os.path.join(d, f"{i:07d}.pt"))


def write_cache(path, args, storage, lengths, pool, pool_scales, pool_groups=None):
    t0 = time.perf_counter()
    with cache_writer(path, args, storage) as w:
        for i, L, rows in sample_rows(lengths, pool):
            cache_append(w, i, L, rows, pool, pool_scales, pool_groups)
    return time.perf_counter() - t0, w.stats


def raw_append(fd, rows, pool) -> None:
    os.write(fd, memoryview(pool[rows].numpy()).cast("B"))


def write_raw(path, lengths, pool) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for _, _, rows in sample_rows(lengths, pool):
        raw_append(fd, rows, pool)
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t0


def write_per_sample(d, lengths, pool) -> float:
    os.makedirs(d)
    t0 = time.perf_counter()
    for i, L, rows in sample_rows(lengths, pool):
        per_sample_save(d, i, L, rows, pool)
    os.sync()
    return time.perf_counter() - t0


def rewrite_interleaved(cache, raw, per, args, lengths, pool) -> None:
    """The bf16 cache, the raw file and the per-sample files written again, sample by sample in turn (untimed),
    for the reads: a disk or host cache below this machine's page cache (a VM's) reads recently written data
    faster, and written one layout after the other the last one would read faster for that alone (on the 2-core
    dev box the cache, written first, read at 0.85 GB/s against 2.2-2.4 GB/s for the raw and per-sample files
    written after it; an in-process probe of the same files an hour later read the cache at 2.05 GB/s)."""
    shutil.rmtree(cache)
    shutil.rmtree(per)
    os.makedirs(per)
    fd = os.open(raw, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with cache_writer(cache, args, "bf16") as w:
            for i, L, rows in sample_rows(lengths, pool):
                cache_append(w, i, L, rows, pool)
                raw_append(fd, rows, pool)
                per_sample_save(per, i, L, rows, pool)
    finally:
        os.close(fd)
    os.sync()


def read_cache(path, *, threads: int, batch_tokens: int, taps=None) -> tuple[float, int]:
    r = CacheReader(path, num_threads=threads)
    K = len(r.tap_positions(taps))
    out = PackedBuffers.allocate(tokens=max(batch_tokens, int(r.index.length.max())), num_taps=K,
                                 hidden_size=r.hidden_size, storage=r.storage)
    out.hidden.zero_()  # the loader allocates (pins) its buffers once; do not time first-touch page faults
    t0 = time.perf_counter()
    batch, tok = [], 0
    for i in range(len(r)):
        L = int(r.index.length[i])
        if tok + L > out.hidden.shape[0]:
            r.read_many(batch, taps=taps, out=out)
            batch, tok = [], 0
        batch.append(i)
        tok += L
    if batch:
        r.read_many(batch, taps=taps, out=out)
    dt = time.perf_counter() - t0
    r.close()
    return dt, r.bytes_read


def read_raw(path) -> float:
    buf = bytearray(8 << 20)
    mv = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(mv):
            pass
    return time.perf_counter() - t0


def read_raw_threaded(path, threads: int) -> float:
    """The file cut into `threads` contiguous ranges, each read sequentially (8 MiB preads) by its own thread
    and fd: the multi-threaded sequential read of the same bytes."""
    size = os.path.getsize(path)
    step = -(-size // threads)

    def part(a: int) -> int:
        buf = np.empty(8 << 20, np.uint8)
        fd = os.open(path, os.O_RDONLY)
        try:
            n, z = 0, min(size, a + step)
            while a < z:
                got = os.preadv(fd, [buf[:min(len(buf), z - a)]], a)
                if got <= 0:
                    break
                a, n = a + got, n + got
            return n
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        assert sum(ex.map(part, range(0, size, step))) == size
    return time.perf_counter() - t0


def read_per_sample(d, threads) -> float:
    files = sorted(all_files(d))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        for _ in ex.map(lambda p: torch.load(p, weights_only=True), files):
            pass
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    K, D = args.taps, args.hidden
    lengths = sample_lengths(rng, args.tokens)
    T = int(lengths.sum())
    payload = T * K * D * 2  # hidden bf16 bytes: the same for cache, raw file and per-sample files
    pool_tokens = 4096 + 8192
    pool = torch.from_numpy(rng.integers(0, 1 << 16, (pool_tokens, K, D), dtype=np.uint16))
    pool = pool.view(torch.bfloat16).float().clamp(-1e4, 1e4).nan_to_num().to(torch.bfloat16).view(torch.uint16)
    if os.path.exists(args.out):
        shutil.rmtree(args.out)
    os.makedirs(args.out)
    cache, raw, per = (os.path.join(args.out, n) for n in ("cache_bf16", "raw.bin", "per_sample"))
    cache8 = os.path.join(args.out, "cache_fp8")

    t_wc, st = write_cache(cache, args, "bf16", lengths, pool, None)
    t_wr = write_raw(raw, lengths, pool)
    t_wp = write_per_sample(per, lengths, pool)
    n8 = max(1, int(len(lengths) * args.fp8_fraction))
    from dflash.cache.format import quantize_fp8
    bits8, scales8 = quantize_fp8(pool.view(torch.bfloat16))
    _, st8 = write_cache(cache8, args, "fp8", lengths[:n8], bits8, scales8)
    del bits8, scales8
    # 4-bit (issue 16, int4-g32-e4m3-h32) over the same samples as fp8: bytes per token and a read of it
    from dflash.cache.format import encode_stored
    cache4 = os.path.join(args.out, "cache_int4")
    enc4 = encode_stored(pool.view(torch.bfloat16), "int4")
    _, st4 = write_cache(cache4, args, "int4", lengths[:n8], enc4.hidden, enc4.scales, enc4.group_scales)
    del enc4

    if args.fair_age:
        rewrite_interleaved(cache, raw, per, args, lengths, pool)
    cold = make_cold([cache, per, cache8, cache4, args.out], args.drop_caches)
    taps2 = list(fingerprint(args, "bf16").tap_layer_ids[:2])
    extra_threads = [int(x) for x in args.cache_threads.split(",") if x.strip()]
    bytes_all = 0

    def cache_read() -> float:
        nonlocal bytes_all
        secs, bytes_all = read_cache(cache, threads=args.threads, batch_tokens=args.batch_tokens)
        return secs

    variants = {"read_raw": lambda: read_raw(raw),
                "read_raw_threaded": lambda: read_raw_threaded(raw, args.threads),
                "read_cache": cache_read,
                "read_per_sample": lambda: read_per_sample(per, args.threads),
                **{f"read_cache_threads_{n}": (lambda n=n: read_cache(cache, threads=n,
                                                                      batch_tokens=args.batch_tokens)[0])
                   for n in extra_threads}}
    reps: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(max(1, args.reps)):
        for name, fn in variants.items():
            make_cold([args.out], args.drop_caches)
            reps[name].append(fn())
    med = {k: statistics.median(v) for k, v in reps.items()}
    t_rr, t_rt, t_rc, t_rp = med["read_raw"], med["read_raw_threaded"], med["read_cache"], med["read_per_sample"]
    make_cold([args.out], args.drop_caches)
    t_rs, bytes_two = read_cache(cache, threads=args.threads, batch_tokens=args.batch_tokens, taps=taps2)
    make_cold([args.out], args.drop_caches)
    t_r4, bytes_4 = read_cache(cache4, threads=args.threads, batch_tokens=args.batch_tokens)

    gbps = lambda b, t: b / t / 1e9  # noqa: E731
    res = {
        "write_ratio_vs_raw": t_wr / t_wc,
        "read_ratio_vs_raw": t_rr / t_rc,
        "read_ratio_vs_raw_threaded": t_rt / t_rc,
        "read_subset_bytes_ratio": bytes_two / bytes_all,
        "read_ratio_vs_per_sample_files": t_rp / t_rc,
        "bytes_per_token_bf16": st.bytes_written / st.tokens,
        "bytes_per_token_fp8": st8.bytes_written / st8.tokens,
        "fp8_over_bf16": (st8.bytes_written / st8.tokens) / (st.bytes_written / st.tokens),
        "bytes_per_token_int4": st4.bytes_written / st4.tokens,
        "int4_over_bf16": (st4.bytes_written / st4.tokens) / (st.bytes_written / st.tokens),
        "int4_storage": "int4-g32-e4m3-h32",
        "gbps": {"write_cache": gbps(payload, t_wc), "write_raw": gbps(payload, t_wr),
                 "write_per_sample": gbps(payload, t_wp), "read_cache": gbps(payload, t_rc),
                 "read_cache_2_taps": gbps(payload * 2 / K, t_rs), "read_raw": gbps(payload, t_rr),
                 "read_per_sample": gbps(payload, t_rp), "read_cache_int4_stored_bytes": gbps(bytes_4, t_r4),
                 "read_raw_threaded": gbps(payload, t_rt),
                 **{k: gbps(payload, med[k]) for k in med if k.startswith("read_cache_threads_")}},
        "read_seconds_per_rep": reps,
        "seconds": {"write_cache": t_wc, "write_raw": t_wr, "write_per_sample": t_wp, "read_cache": t_rc,
                    "read_cache_2_taps": t_rs, "read_raw": t_rr, "read_per_sample": t_rp, "read_cache_int4": t_r4,
                    "writer_blocked": st.seconds_blocked},
        "cold_reads": cold,
        "config": {"taps": K, "hidden": D, "tokens": T, "samples": len(lengths), "payload_bytes": payload,
                   "mean_length": float(lengths.mean()), "threads": args.threads, "batch_tokens": args.batch_tokens,
                   "shard_tokens": args.shard_tokens, "chunk_bytes": args.chunk_bytes,
                   "block_bytes": args.block_bytes, "seed": args.seed, "reps": max(1, args.reps),
                   "read_files_rewritten_interleaved": args.fair_age,
                   "shards": st.shards_committed, "fp8_tokens": st8.tokens, "int4_tokens": st4.tokens},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "disk": _disk(args.out)},
        "versions": _versions(),
        "command": " ".join([sys.executable] + sys.argv),
    }
    rows = [("cache write", res["gbps"]["write_cache"]), ("raw write", res["gbps"]["write_raw"]),
            ("per-sample write", res["gbps"]["write_per_sample"]), ("cache read", res["gbps"]["read_cache"]),
            ("cache read 2 taps", res["gbps"]["read_cache_2_taps"]), ("raw read", res["gbps"]["read_raw"]),
            (f"raw read {args.threads} threads", res["gbps"]["read_raw_threaded"]),
            ("per-sample read", res["gbps"]["read_per_sample"]),
            *[(f"cache read {n} threads", res["gbps"][f"read_cache_threads_{n}"]) for n in extra_threads]]
    print(f"{T:,} tokens, {len(lengths)} samples, {payload / 1e9:.2f} GB hidden, reads: {cold}")
    for name, v in rows:
        print(f"  {name:<20}{v:8.2f} GB/s")
    for k in ("write_ratio_vs_raw", "read_ratio_vs_raw", "read_ratio_vs_raw_threaded", "read_subset_bytes_ratio",
              "read_ratio_vs_per_sample_files",
              "bytes_per_token_bf16", "bytes_per_token_fp8", "fp8_over_bf16", "bytes_per_token_int4", "int4_over_bf16"):
        print(f"  {k:<32}{res[k]:10.3f}")
    os.makedirs(args.results_dir, exist_ok=True)
    with open(os.path.join(args.results_dir, f"cache_{args.result_name}.json"), "w") as f:
        json.dump(res, f, indent=1)
    if not args.keep:
        shutil.rmtree(args.out)
    print(json.dumps(res))
    return res


def _disk(path: str) -> dict:
    s = shutil.disk_usage(path)
    return {"total_gb": s.total / 1e9, "free_gb": s.free / 1e9}


def _versions() -> dict:
    import crc32c
    v = {"torch": torch.__version__, "numpy": np.__version__, "crc32c": getattr(crc32c, "__version__", "?")}
    for m in ("zarr", "numcodecs"):
        try:
            v[m] = __import__(m).__version__
        except ImportError:
            v[m] = None
    return v


if __name__ == "__main__":
    main()
