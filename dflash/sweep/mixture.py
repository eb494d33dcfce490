"""Mixture sweeps: runs of one group that differ in cache_weights, trained side by side off one read of each
cache.

Runs of different weights visit different samples in a different order, so they cannot share micro-batches as
the runs of one stream do. Each distinct weight vector gets its own stream (train.driver.run_stream in a
thread of its own), and all streams read through one SharedReads over the group's caches: a sample is read
from disk once, by whichever stream asks first, held in host memory, and handed to the other streams that use
it until its last use (counted beforehand from the streams' plans), then dropped. The streams step in lock-step
(Lockstep), so a held sample waits only as long as the gap between the streams' positions in each cache.

Tradeoff: host memory. Two streams draw cache c at rates w_c / W and w'_c / W' per slot, so after k slots a
sample taken by the faster one waits about k |w_c/W - w'_c/W'| slots for the slower one: the held bytes grow
through the run (peak_held_bytes in the group's streams JSON says how far). A sweep whose held bytes would not
fit should run its weights in separate sweeps (each reads the caches once more).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

import numpy as np

from dflash.cache.reader import PackedBuffers, PackedSamples, stored_samples


@dataclasses.dataclass
class _Held:
    arrays: dict  # name -> tensor rows of one sample (raw stored dtype)
    nbytes: int


class SharedReads:
    """Per-sample reads of a MixedReader shared by several streams (module docstring). uses[g]: how many
    times the streams will read global sample g (an underestimate only costs re-reads, an overestimate
    holds a sample to the end)."""

    def __init__(self, mixed, uses: np.ndarray) -> None:
        self.mixed = mixed
        self.remaining = np.asarray(uses, dtype=np.int64).copy()
        self._held: dict[int, _Held] = {}
        self._inflight: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self.disk_samples = 0
        """Samples read from disk (once each when sharing works)."""
        self.held_bytes = 0
        self.peak_held_bytes = 0

    def view(self) -> "SharedView":
        return SharedView(self)

    def _read_own(self, own: list[int], taps) -> dict[int, _Held]:
        if not own:
            return {}
        lengths = self.mixed.index.length[own]
        tmp = PackedBuffers.allocate(tokens=int(lengths.sum()), num_taps=len(self.mixed.tap_positions(taps)),
                                     hidden_size=self.mixed.hidden_size, storage=self.mixed.storage)
        self.mixed.read_many(own, taps=taps, out=tmp)
        out, t0 = {}, 0
        for g, n in zip(own, lengths.tolist()):
            arrays = {name: getattr(tmp, name)[t0:t0 + n].clone() for name in
                      ("hidden", "scales", "input_ids", "loss_mask", "group_scales") if getattr(tmp, name) is not None}
            out[g] = _Held(arrays=arrays, nbytes=sum(a.numel() * a.element_size() for a in arrays.values()))
            t0 += n
        return out

    def read_into(self, idx: np.ndarray, taps, out: PackedBuffers) -> None:
        uniq, uses = np.unique(idx, return_counts=True)
        waits: list[threading.Event] = []
        with self._lock:
            own = [int(g) for g in uniq if int(g) not in self._held and int(g) not in self._inflight]
            for g in uniq.tolist():
                if g in self._inflight:
                    waits.append(self._inflight[g])
            for g in own:
                self._inflight[g] = threading.Event()
        try:
            got = self._read_own(own, taps)
        finally:
            with self._lock:
                for g, h in got.items():
                    self._held[g] = h
                    self.held_bytes += h.nbytes
                self.disk_samples += len(got)
                self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
                for g in own:
                    self._inflight.pop(g).set()
        for e in waits:
            e.wait()
        with self._lock:
            entries = {g: self._held.get(g) for g in uniq.tolist()}
        missing = [g for g, h in entries.items() if h is None]  # released early (uses undercounted): read again
        if missing:
            extra = self._read_own(missing, taps)
            with self._lock:
                self.disk_samples += len(extra)
            entries.update(extra)
        t0 = 0
        for g in idx.tolist():
            h = entries[g]
            n = int(h.arrays["input_ids"].shape[0])
            for name, a in h.arrays.items():
                getattr(out, name)[t0:t0 + n] = a
            t0 += n
        with self._lock:
            for g, u in zip(uniq.tolist(), uses.tolist()):
                self.remaining[g] -= u
                if self.remaining[g] <= 0 and g in self._held:
                    self.held_bytes -= self._held.pop(g).nbytes


class SharedView:
    """What one stream sees: the MixedReader interface training uses, reading through SharedReads."""

    def __init__(self, shared: SharedReads) -> None:
        m = shared.mixed
        self.shared = shared
        self.readers, self.path, self.paths = m.readers, m.path, m.paths
        self.manifest, self.fingerprint = m.manifest, m.fingerprint
        self.tap_layer_ids, self.storage, self.hidden_size, self.layout = (m.tap_layer_ids, m.storage, m.hidden_size,
                                                                           m.layout)
        self.counts, self.offsets, self.index = m.counts, m.offsets, m.index

    @property
    def bytes_read(self) -> int:
        return self.shared.mixed.bytes_read

    def __len__(self) -> int:
        return int(self.counts.sum())

    def tap_positions(self, taps):
        return self.shared.mixed.tap_positions(taps)

    def cache_of(self, indices) -> np.ndarray:
        return self.shared.mixed.cache_of(indices)

    def read_many(self, indices, *, taps=None, out: PackedBuffers | None = None, **kw) -> PackedSamples:
        assert not kw.get("dequantize")
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        lengths = self.index.length[idx]
        T = int(lengths.sum())
        if out is None:
            out = PackedBuffers.allocate(tokens=T, num_taps=len(self.tap_positions(taps)),
                                         hidden_size=self.hidden_size, storage=self.storage)
        self.shared.read_into(idx, taps, out)
        return stored_samples(out, sample_ids=self.index.sample_id[idx], lengths=lengths, storage=self.storage,
                              layout=self.layout)

    def close(self) -> None:
        pass


class Lockstep:
    """Keeps threads at the same optimizer step: step(k, s) returns once every other live participant has
    reached step s too; leave(k) when a participant ends (or fails), so nobody waits for it."""

    def __init__(self, n: int) -> None:
        self._pos = {k: -1 for k in range(n)}
        self._cond = threading.Condition()

    def step(self, k: int, s: int) -> None:
        with self._cond:
            self._pos[k] = s
            self._cond.notify_all()
            self._cond.wait_for(lambda: all(p >= s for p in self._pos.values()))

    def leave(self, k: int) -> None:
        with self._cond:
            self._pos.pop(k, None)
            self._cond.notify_all()


def plan_uses(cfgs: Sequence, steps: Sequence[int], *, index, counts: np.ndarray,
              costs: np.ndarray | None) -> tuple[np.ndarray, list[np.ndarray]]:
    """(uses per global sample over all streams, the unique samples each stream uses): stream k (config
    cfgs[k]) runs steps[k] optimizer steps of its epoch plans (world size 1, as a sweep group) over the samples
    of `index` (the mixed reader's SampleIndex)."""
    from dflash.train.loader import config_plan

    uses = np.zeros(len(index.length), dtype=np.int64)
    used = []
    for cfg, total in zip(cfgs, steps):
        parts, done, epoch = [], 0, 0
        while done < total:
            plan = config_plan(cfg, index, epoch=epoch, world_size=1, costs=costs, counts=counts)
            take = plan.steps[:total - done]
            parts += [mb for s in take for mb in s]
            done += len(take)
            epoch += 1
        idx = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        np.add.at(uses, idx, 1)
        used.append(np.unique(idx))
    return uses, used


def run_threads(jobs: Sequence[Callable[[Callable[[int], None], Callable[[], bool]], object]],
                stop: Callable[[], bool] = lambda: False) -> list:
    """Run each job(before_step, terminate) in its own thread, in lock-step; returns their results in order and
    re-raises the first failure. terminate() answers stop() once per global step, the first thread to ask at a
    step deciding for all, so the streams stop at one step (a SIGTERM read at different moments would split
    them)."""
    lock = Lockstep(len(jobs))
    errors: list[BaseException] = []
    results: list = [None] * len(jobs)
    decided: dict[int, bool] = {}
    guard = threading.Lock()

    def body(k: int) -> None:
        at = [0]

        def before(s: int) -> None:
            at[0] = s
            lock.step(k, s)

        def terminate() -> bool:
            with guard:
                if at[0] not in decided:
                    decided[at[0]] = stop()
                return decided[at[0]]
        try:
            results[k] = jobs[k](before, terminate)
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            errors.append(e)
        finally:
            lock.leave(k)

    threads = [threading.Thread(target=body, args=(k,), name=f"dflash-mix-{k}") for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


__all__ = ["SharedReads", "SharedView", "Lockstep", "plan_uses", "run_threads"]
