"""Tokenize the data once, in parallel, and keep the result next to the cache for reruns.

Each rank tokenizes the sample ids with id % W == rank (W = number of ranks) in worker processes and writes
CACHE/_tokenized/KEY/part-R-of-W.npz atomically; after a barrier every rank memory-maps all W parts and
merges them into sample-id order. KEY hashes everything tokenization depends on (sources, tokenizer, chat
template, template kwargs, max_length, transformers version), so a rerun with the same inputs loads the parts
instead of tokenizing (any complete set of one W, so a rerun may use another rank count), and a changed input
tokenizes again under a new KEY. Readers of the cache never look at _tokenized.

The result is exactly what dflash.data.load_samples returns: the same samples in id order (here as views into
the flat arrays, a few bytes of index per sample) and the same skip counts and examples (every part keeps its
first examples per reason with their ids; the merge keeps the globally first ones).

Part layout (uncompressed npz, N = samples of the part, T = their tokens): ids int32 [T], masks uint8 [T],
offsets int64 [N+1], sample_ids int64 [N], source_index int32 [N], skips and meta uint8 (JSON bytes).
"""

from __future__ import annotations

import errno
import io
import json
import operator
import os
import re
import shutil
import struct
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dflash.cache.commit import TOKENIZED as TOKENIZED_DIR  # noqa: F401 - re-exported; the writer tolerates it
from dflash.durable import fsync_dir
from dflash.data.samples import TokenizedSample
from dflash.data.skips import Skip, SkipCounter
from dflash.errors import OutOfSpaceError

FORMAT_VERSION = 1
MAX_WORKERS = 32
SMALL_DATA_BYTES = 4 << 20
_PART_RE = re.compile(r"^part-(\d+)-of-(\d+)\.npz$")


def tokenization_key(*, sources: Sequence[dict], paths: Sequence[str], tokenizer_hash: str,
                     chat_template_hash: str, template_kwargs: dict, max_length: int | None) -> str:
    """Hash of every input of tokenization. `sources`: the fingerprint's [{"path", "sha256"}]; `paths`: the
    data paths as given (skip locations quote them)."""
    import transformers

    from dflash.target.identity import sha256_json

    return sha256_json({
        "version": FORMAT_VERSION, "sources": [dict(s) for s in sources], "paths": [str(p) for p in paths],
        "tokenizer_hash": tokenizer_hash, "chat_template_hash": chat_template_hash,
        "template_kwargs": template_kwargs or {}, "max_length": max_length,
        "transformers": transformers.__version__,
    })[:32]


def default_num_workers(*, local_world_size: int, data_bytes: int | None = None) -> int:
    """Tokenizer processes per rank: the cores split between the local ranks, capped. 0 (tokenize in the
    rank itself) when that is one core, or when the data is small (under SMALL_DATA_BYTES, a few seconds of
    tokenizing): a worker process costs seconds to start (it imports transformers)."""
    if data_bytes is not None and data_bytes < SMALL_DATA_BYTES:
        return 0
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    n = min(MAX_WORKERS, max(1, cores // max(local_world_size, 1)))
    return 0 if n == 1 else n


def starts_pretokenized(paths: Sequence[str], *, probe: int = 8) -> bool:
    """True when the records among the first `probe` items of every source are pre-tokenized (`input_ids`, e.g.
    the output of `dflash generate`). Then worker processes have nothing to do: the parent parses every record either way,
    and a worker would only re-check ids that it is sent pickled, after seconds of start-up (measured: ~3 s of
    the 8.8 s setup of benchmarks/results/extract_h200.json). A later conversation record is still tokenized,
    in the rank's own process."""
    from dflash.data.sources import Record, iter_records

    for path in paths:
        seen = 0
        for item in iter_records(path):
            if isinstance(item, Record) and item.messages is not None:
                return False
            seen += 1
            if seen >= probe:  # items, not records: a source of bad lines is not read to its end here
                break
    return True


@dataclass(frozen=True, kw_only=True)
class Part:
    """One rank's share, in memory or memory-mapped from its file."""

    ids: np.ndarray
    """int32 [T]: all token ids of the part, sample after sample."""
    masks: np.ndarray
    """uint8 [T]: loss masks, aligned with ids."""
    offsets: np.ndarray
    """int64 [N+1]: sample j is ids[offsets[j]:offsets[j+1]]."""
    sample_ids: np.ndarray
    """int64 [N], increasing."""
    source_index: np.ndarray
    """int32 [N]."""
    skips: dict
    """{"counts": {reason: n}, "first": {reason: first sample id}, "examples": [[sid, reason, location, detail]]}."""


class TokenizedSamples(Sequence):
    """The merged samples in id order; item i is a TokenizedSample whose arrays are views into its part."""

    def __init__(self, parts: list[Part]) -> None:
        self.parts = parts
        sids = np.concatenate([p.sample_ids for p in parts]) if parts else np.zeros(0, np.int64)
        which = np.concatenate([np.full(len(p.sample_ids), k, dtype=np.int32) for k, p in enumerate(parts)]
                               ) if parts else np.zeros(0, np.int32)
        local = np.concatenate([np.arange(len(p.sample_ids), dtype=np.int64) for p in parts]
                               ) if parts else np.zeros(0, np.int64)
        order = np.argsort(sids, kind="stable")
        self.sample_ids = np.ascontiguousarray(sids[order])
        """int64 [N] in increasing order."""
        self._part = which[order]
        self._local = local[order]
        lens = np.concatenate([np.diff(p.offsets) for p in parts]) if parts else np.zeros(0, np.int64)
        self.lengths = np.ascontiguousarray(lens[order].astype(np.int64))
        """int64 [N]: tokens per sample."""

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = operator.index(i)
        if i < 0:
            i += len(self)
        p = self.parts[int(self._part[i])]
        j = int(self._local[i])
        a, b = int(p.offsets[j]), int(p.offsets[j + 1])
        return TokenizedSample(sample_id=int(self.sample_ids[i]), input_ids=p.ids[a:b], loss_mask=p.masks[a:b],
                               source_index=int(p.source_index[j]))


@dataclass(frozen=True, kw_only=True)
class Tokenized:
    """What tokenize_or_load produced and how."""

    samples: TokenizedSamples
    skips: SkipCounter
    seconds: float
    """Wall time of this stage on this rank (tokenizing + writing + waiting, or loading)."""
    loaded: bool
    """True when stored parts were loaded (nothing was tokenized)."""
    folder: str | None
    """Where the parts are stored (None: kept in memory only)."""
    num_workers: int
    """Tokenizer processes per rank (0 = in the rank's own process)."""


def tokenize_or_load(*, paths: Sequence[str], tokenizer, max_length: int | None, template_kwargs: dict,
                     folder: str | None, rank: int = 0, world_size: int = 1, distributed: bool = False,
                     num_workers: int | None = None, show_progress: bool = False) -> Tokenized:
    """Load the complete stored parts in `folder` (CACHE/_tokenized/KEY), or tokenize this rank's share
    (ids with id % world_size == rank), store it there and load every part after a barrier. With
    distributed=False this process does all ids (W = 1). folder=None tokenizes in memory and stores nothing.
    Every rank of a distributed run must call this (collectives)."""
    t0 = time.perf_counter()
    if not distributed:
        rank, world_size = 0, 1
    if num_workers is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        num_workers = 0 if starts_pretokenized(paths) else default_num_workers(
            local_world_size=local, data_bytes=_data_bytes(paths))
    found = find_complete_parts(folder, prefer_world_size=world_size) if folder else None
    if distributed:  # one decision for all ranks: every rank tokenizes (and meets the barrier) or none does
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if found else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not int(flag[0]):
            found = None
    if found:
        parts = [load_part(p) for p in found]
        return Tokenized(samples=TokenizedSamples(parts), skips=merge_skips(parts),
                         seconds=time.perf_counter() - t0, loaded=True, folder=folder, num_workers=num_workers)
    part = tokenize_part(paths=paths, tokenizer=tokenizer, max_length=max_length, template_kwargs=template_kwargs,
                         rank=rank, world_size=world_size, num_workers=num_workers, show_progress=show_progress)
    if folder is not None:
        write_part(folder, part, rank=rank, world_size=world_size)
    if distributed:
        import torch.distributed as dist

        dist.barrier()
    if folder is not None:
        part_paths = [part_path(folder, r, world_size) for r in range(world_size)]
        parts = [part if r == rank else load_part(p) if os.path.exists(p)
                 else _tokenize_elsewhere_part(folder, r, world_size, paths=paths, tokenizer=tokenizer,
                                               max_length=max_length, template_kwargs=template_kwargs,
                                               num_workers=num_workers)
                 for r, p in enumerate(part_paths)]
    else:
        parts = [part]
    return Tokenized(samples=TokenizedSamples(parts), skips=merge_skips(parts), seconds=time.perf_counter() - t0,
                     loaded=False, folder=folder, num_workers=num_workers)


def _tokenize_elsewhere_part(folder: str, rank: int, world_size: int, **kw) -> Part:
    """Rank `rank`'s part when it wrote it on another node (multi-node runs with a local scratch folder per
    node, e.g. `extract --output s3://...`): tokenizing is deterministic, so tokenize it here too and store
    it, so that this node's folder is complete for a resume."""
    part = tokenize_part(rank=rank, world_size=world_size, **kw)
    write_part(folder, part, rank=rank, world_size=world_size)
    return part


def tokenize_part(*, paths: Sequence[str], tokenizer, max_length: int | None, template_kwargs: dict,
                  rank: int, world_size: int, num_workers: int, show_progress: bool = False,
                  max_examples: int = SkipCounter().max_examples) -> Part:
    """Tokenize the ids with id % world_size == rank. The progress bar counts this rank's records times
    world_size: an estimate of the whole run's rate (the ranks share the records round-robin)."""
    from tqdm import tqdm

    from dflash.data.samples import iter_results

    results = iter_results(paths, tokenizer, max_length=max_length, template_kwargs=template_kwargs or None,
                           rank=rank, world_size=world_size, num_workers=num_workers)
    ids, masks, lens, sids, srcs = [], [], [], [], []
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    examples: list[list] = []
    total = estimate_num_records(paths) if show_progress else None
    with tqdm(total=total, desc="tokenizing", unit=" records", disable=not show_progress, dynamic_ncols=True,
              mininterval=1.0, smoothing=0.05) as bar:
        for sid, src, result in results:
            bar.update(world_size)
            if isinstance(result, Skip):
                n = counts.get(result.reason, 0)
                counts[result.reason] = n + 1
                first.setdefault(result.reason, sid)
                if n < max_examples:
                    examples.append([sid, result.reason, result.location, result.detail])
                continue
            ids_T, mask_T = result
            ids.append(np.asarray(ids_T, dtype=np.int32))
            masks.append(np.asarray(mask_T, dtype=np.uint8))
            lens.append(len(ids_T))
            sids.append(sid)
            srcs.append(src)
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lens, dtype=np.int64), out=offsets[1:])
    return Part(ids=np.concatenate(ids) if ids else np.zeros(0, np.int32),
                masks=np.concatenate(masks) if masks else np.zeros(0, np.uint8),
                offsets=offsets, sample_ids=np.asarray(sids, dtype=np.int64),
                source_index=np.asarray(srcs, dtype=np.int32),
                skips={"counts": counts, "first": first, "examples": examples})


def merge_skips(parts: list[Part], *, max_examples: int = SkipCounter().max_examples) -> SkipCounter:
    """The SkipCounter a single pass over all ids would have built: counts summed (reasons in the order
    first met), the first `max_examples` examples per reason in id order."""
    counter = SkipCounter(max_examples=max_examples)
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for p in parts:
        for reason, n in p.skips["counts"].items():
            counts[reason] = counts.get(reason, 0) + int(n)
            first[reason] = min(first.get(reason, 1 << 62), int(p.skips["first"][reason]))
    counter.counts = {r: counts[r] for r in sorted(counts, key=lambda r: first[r])}
    kept: dict[str, int] = {}
    for sid, reason, location, detail in sorted((e for p in parts for e in p.skips["examples"]),
                                                key=lambda e: e[0]):
        if kept.get(reason, 0) < max_examples:
            kept[reason] = kept.get(reason, 0) + 1
            counter.examples.append(Skip(reason, location, detail))
    return counter


def estimate_num_records(paths: Sequence[str]) -> int | None:
    """Records of all sources when cheap to count (.jsonl lines, parquet metadata); None otherwise."""
    total = 0
    for p in paths:
        name = os.path.basename(str(p)).lower()
        if name.endswith(".jsonl") and os.path.isfile(p):
            with open(p, "rb") as f:
                total += sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 24), b""))
        elif name.endswith(".parquet") and os.path.isfile(p):
            import pyarrow.parquet as pq

            total += pq.ParquetFile(p).metadata.num_rows
        else:
            return None
    return total


def _data_bytes(paths: Sequence[str]) -> int:
    total = 0
    for p in paths:
        if os.path.isdir(p):
            total += sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs)
        elif os.path.isfile(p):
            total += os.path.getsize(p)
    return total


# -- files ------------------------------------------------------------------------------------------------

def part_path(folder: str, rank: int, world_size: int) -> str:
    return os.path.join(folder, f"part-{rank}-of-{world_size}.npz")


def find_complete_parts(folder: str, *, prefer_world_size: int) -> list[str] | None:
    """Paths of a complete set part-0..W-1-of-W in `folder` (W = prefer_world_size when complete, else the
    smallest complete W), or None."""
    if not os.path.isdir(folder):
        return None
    have: dict[int, set[int]] = {}
    for name in os.listdir(folder):
        m = _PART_RE.match(name)
        if m:
            have.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    complete = sorted(w for w, ranks in have.items() if ranks == set(range(w)))
    if not complete:
        return None
    w = prefer_world_size if prefer_world_size in complete else complete[0]
    return [part_path(folder, r, w) for r in range(w)]


def write_part(folder: str, part: Part, *, rank: int, world_size: int) -> str:
    """Write part-R-of-W.npz atomically: a reader sees the whole file or none (tmp + fsync + rename)."""
    dest = part_path(folder, rank, world_size)
    tmp = f"{dest}.tmp-{os.getpid()}"
    meta = {"version": FORMAT_VERSION, "rank": rank, "world_size": world_size}
    try:
        os.makedirs(folder, exist_ok=True)
        with open(tmp, "wb") as f:
            np.savez(f, ids=part.ids, masks=part.masks, offsets=part.offsets, sample_ids=part.sample_ids,
                     source_index=part.source_index, skips=_json_bytes(part.skips), meta=_json_bytes(meta))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
        fsync_dir(folder)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        from dflash.extract.space import format_bytes

        free = shutil.disk_usage(folder if os.path.isdir(folder) else os.path.dirname(folder)).free
        raise OutOfSpaceError(f"no space left on device while storing the tokenization {dest} "
                              f"(needs about {format_bytes(part.ids.nbytes + part.masks.nbytes)}, "
                              f"{format_bytes(free)} free): free space and rerun the same command") from e
    return dest


def load_part(path: str) -> Part:
    a = npz_memmap(path)
    meta = json.loads(bytes(a["meta"]))
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: tokenized part version {meta.get('version')}, expected {FORMAT_VERSION}")
    return Part(ids=a["ids"], masks=a["masks"], offsets=np.asarray(a["offsets"]),
                sample_ids=np.asarray(a["sample_ids"]),
                source_index=np.asarray(a["source_index"]), skips=json.loads(bytes(a["skips"])))


def _json_bytes(obj) -> np.ndarray:
    return np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)


def npz_memmap(path: str) -> dict[str, np.ndarray]:
    """The arrays of an uncompressed .npz as read-only memory maps (np.load reads npz members into memory)."""
    out: dict[str, np.ndarray] = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            name = info.filename.removesuffix(".npy")
            if info.compress_type != zipfile.ZIP_STORED:
                out[name] = np.load(io.BytesIO(z.read(info.filename)))
                continue
            f.seek(info.header_offset)
            header = f.read(30)  # local file header: fixed part, then name and extra field
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            f.seek(info.header_offset + 30 + name_len + extra_len)
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
            if int(np.prod(shape)) == 0:
                out[name] = np.zeros(shape, dtype=dtype)
            else:
                out[name] = np.memmap(path, dtype=dtype, mode="r", offset=f.tell(), shape=shape,
                                      order="F" if fortran else "C")
    return out
