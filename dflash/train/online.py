"""`dflash train --online`: the live target computes the drafter's taps for every micro-batch (the mode the
cache replaces; kept as the baseline that shows the cache is lossless and what it saves).

The loader still streams the cache for the token stream (same sample order, ids, loss masks and anchors as a
cached run with the same seed) but reads no hidden bytes; `OnlineTaps.fill` runs the target up to the deepest
tap on those ids and puts the tapped residual streams where the cache's features would have been.

Shapes: T = packed tokens of the micro-batch, N = samples, B = rows of one target forward, S = padded length,
K = taps, D = hidden size.

Batching: the micro-batch's samples are sorted by length and cut into forward batches of at most
`batch_tokens` padded tokens (dflash.data.batching, as extraction does), right-padded (causal layers: real
tokens never see the pads), and the real rows are scattered back to their packed positions. Nothing in it waits
for the GPU: the index maps (forward_index_maps) are built on the host and copied once per forward batch from
pinned memory, and rows move by index, never by boolean mask (which needs the selected count on the host).
Tradeoff: one target replica per rank in the compute dtype, on top of the drafter; the target forward runs
in the training loop, so it is counted in the run's tokens/s (that is the cost the cache removes).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

import numpy as np
import torch

from dflash.cache.format import decode_stored, encode_stored
from dflash.dtypes import DTYPES, default_dtype, dtype_of
from dflash.train.loader import MicroBatch

log = logging.getLogger(__name__)

def online_target_dtype(cache_target_dtype: str, device: torch.device) -> torch.dtype:
    """The dtype the cache was extracted in (the faithful baseline); bf16 on CUDA / fp32 on CPU if unknown."""
    return dtype_of(cache_target_dtype if cache_target_dtype in DTYPES else default_dtype(device))


def forward_batches(lengths_N: np.ndarray, *, batch_tokens: int) -> list[np.ndarray]:
    """Sample positions of a micro-batch grouped into padded forward batches (len x max length <= budget), of
    round sizes as in extraction (FLA compiles per batch size: dflash.data.batching)."""
    from dflash.data.batching import token_budget_batches

    return token_budget_batches(np.asarray(lengths_N, dtype=np.int64), max_tokens=batch_tokens, round_sizes=True)


def forward_index_maps(starts_G: np.ndarray, lengths_G: np.ndarray, *, pad_src: int) -> tuple[np.ndarray, np.ndarray]:
    """Host index maps of one forward batch of G packed samples, right-padded to S = their max length:
    src_GS[g, s] = the packed position of row g's token s, pad_src past the row's end; real_R = the flat
    positions g * S + s of the real tokens, row-major (src_GS.ravel()[real_R] are their packed positions)."""
    S = int(lengths_G.max())
    valid_GS = np.arange(S)[None, :] < lengths_G[:, None]
    src_GS = np.where(valid_GS, starts_G[:, None] + np.arange(S)[None, :], pad_src).astype(np.int64)
    return src_GS, np.flatnonzero(valid_GS).astype(np.int64)


def live_taps(cfg, taps: tuple[int, ...], *, reader, device: torch.device) -> "OnlineTaps | None":
    """The live target of a TrainConfig with online set (None otherwise): the cache's target dtype and the config's
    forward budget. `taps`: the ones the stream computes (a sweep group's union). Each run rounds them through its
    own online_storage (fill)."""
    if not cfg.online:
        return None
    from dflash.compiled import compile_wanted

    return OnlineTaps.load(cfg.model, taps, device=device, batch_tokens=cfg.batch_tokens,
                           dtype=online_target_dtype(reader.fingerprint.target_dtype, device),
                           compile_layers=compile_wanted(cfg.online_compile, device))


class OnlineTaps:
    """The live target of an online run: fills MicroBatch.hidden_TKD from the micro-batch's input ids."""

    def __init__(self, model: torch.nn.Module, taps: tuple[int, ...], *, dtype: torch.dtype,
                 batch_tokens: int, pad_id: int = 0, compile_layers: bool = False) -> None:
        from dflash.target.forward import TappedForward

        self.model, self.taps, self.dtype = model, tuple(taps), dtype
        self.tapped = TappedForward(model, self.taps, compile_layers=compile_layers)
        self.batch_tokens, self.pad_id = batch_tokens, pad_id
        self.forward_s = 0.0      # host wall time in fill() (on CUDA: queueing, not kernel time)
        self.tokens = 0

    @classmethod
    def load(cls, model_path: str, taps: tuple[int, ...], *, device: torch.device, dtype: torch.dtype,
             batch_tokens: int, compile_layers: bool = False) -> "OnlineTaps":
        from dflash.target.load import load_target

        model, tokenizer = load_target(model_path, device=device, dtype=dtype)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        log.info("online: live target %s (%s%s) computes taps %s for every micro-batch", model_path, dtype,
                 ", compiled layers" if compile_layers else "", list(taps))
        return cls(model, taps, dtype=dtype, batch_tokens=batch_tokens, pad_id=int(pad), compile_layers=compile_layers)

    def hidden(self, input_ids_T: torch.Tensor, lengths_N: np.ndarray) -> torch.Tensor:
        """Tapped target hidden states [T, K, D] (the target's dtype) of packed samples, in packed order."""
        import time

        t0 = time.perf_counter()
        lengths = np.asarray(lengths_N, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        T, device = int(starts[-1]), input_ids_T.device
        out_TKD: torch.Tensor | None = None
        ids_T1 = torch.cat([input_ids_T, input_ids_T.new_full((1,), self.pad_id)])  # position T: the pad id
        for group in forward_batches(lengths, batch_tokens=max(self.batch_tokens, int(lengths.max()))):
            src_BS, real = forward_index_maps(starts[group], lengths[group], pad_src=T)
            B, S = src_BS.shape
            # no boolean-mask indexing: it would wait for the GPU to count the selected rows
            src, real = self._to_device(np.concatenate([src_BS.ravel(), real]), device).split([B * S, len(real)])
            hidden_BSKD = self.tapped(ids_T1[src.view(B, S)])
            K, D = hidden_BSKD.shape[2], hidden_BSKD.shape[3]
            if out_TKD is None:
                out_TKD = torch.empty(T, K, D, dtype=hidden_BSKD.dtype, device=device)
            out_TKD.index_copy_(0, src.index_select(0, real), hidden_BSKD.reshape(B * S, K, D).index_select(0, real))
        assert out_TKD is not None
        self.forward_s += time.perf_counter() - t0
        self.tokens += T
        return out_TKD

    @staticmethod
    def _to_device(host: np.ndarray, device: torch.device) -> torch.Tensor:
        """One copy of the host index maps. On CUDA from pinned memory: a copy from pageable memory makes the
        host wait for every kernel already queued (CUDA does a stream sync before it), so the host could not
        queue the forward while the GPU still runs the previous step."""
        t = torch.from_numpy(host)
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t

    def fill(self, mb: MicroBatch, dtype: torch.dtype, *,
             storages: Iterable[str | None] = (None,)) -> dict[str | None, MicroBatch]:
        """Storage -> the micro-batch with hidden_TKD computed by the target (one forward for all) and cast to
        the drafter's compute dtype; for a storage (None: unrounded), encoded and decoded by the functions the
        extractor and the loader call on a cache of it (per token and tap, so the forward batching does not
        change the result). One entry per distinct storage of `storages` (the runs of a sweep group)."""
        out = {}
        with torch.inference_mode():
            h = self.hidden(mb.input_ids_T, mb.lengths)
            for storage in dict.fromkeys(storages):
                x = h
                if storage is not None:
                    enc = encode_stored(h, storage)
                    x = decode_stored(enc.hidden, enc.scales, enc.group_scales, storage=storage, dtype=dtype)
                out[storage] = x
        # normal tensors (cloned outside inference mode): inference tensors cannot be saved for the backward
        return {storage: dataclasses.replace(mb, hidden_TKD=x.to(dtype).clone()) for storage, x in out.items()}
