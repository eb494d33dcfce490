"""`dflash serve-check --responses FILE`: the check's requests and dflash eval's accept chains from a `dflash
generate` output file instead of an eval cache.

Without a cache there are no stored features, so the target runs here, once per record, to give the drafter's
taps (HF hidden_states[k + 1], as extraction stores them); the chains then come from dflash eval's own offline
code (dflash.eval.tau.accept_lengths and walk_accept_chain). Only records that `dflash generate` marked greedy
are accepted: another response is not the path a greedy target takes, and its chain would not be exact.
Tradeoff: a full-precision forward of the target per record on this machine (seconds for SmolLM2 on CPU; a
27B target wants a GPU, or the eval cache the training run already made).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from dflash.errors import DataError
from dflash.serve.request import CheckRequest

if TYPE_CHECKING:
    from dflash.eval.evaluate import TauStats


def read_responses(paths, *, limit: int | None = None) -> list[CheckRequest]:
    """The greedy first-turn responses of `dflash generate` files (>= 2 tokens each, in file and line order;
    sample_id = the record's running index over the files, as extraction numbers them)."""
    out: list[CheckRequest] = []
    index = 0
    for path in [paths] if isinstance(paths, (str, Path)) else list(paths):
        with open(path) as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                if limit is not None and index >= limit:
                    return out
                rec = json.loads(line)
                meta = rec.get("dflash_generate")
                where = f"{path}:{i + 1}"
                if not meta or "input_ids" not in rec:
                    raise DataError(f"{where} is not a `dflash generate` record (no dflash_generate/input_ids)")
                if not meta.get("greedy"):
                    raise DataError(f"{where} was not generated greedily: its accept chain would not be exact")
                n = int(meta["num_prompt_tokens"])
                resp = [int(t) for t in meta["response_ids"]]
                if rec["input_ids"][n: n + len(resp)] != resp:
                    raise DataError(f"{where}: response_ids do not follow the prompt in input_ids")
                if len(resp) >= 2:
                    out.append(CheckRequest(sample_id=index, prompt_ids=[int(t) for t in rec["input_ids"][:n]],
                                            response_ids=resp))
                index += 1
    return out


def offline_stats(*, drafter_dir: str, model: str, requests: list[CheckRequest], dtype: str = "float32",
                  device: str | None = None) -> TauStats:
    """dflash eval's accept-chain statistics (TauStats: step counts, tau, each request's chain by sample id) over
    the requests, from the target's features computed here."""
    import torch

    from dflash.drafter.export import load_drafter
    from dflash.dtypes import dtype_of
    from dflash.eval.evaluate import TauStats
    from dflash.eval.live import tap_features
    from dflash.eval.tau import accept_lengths, walk_accept_chain
    from dflash.target.head import embedding_and_head
    from dflash.target.load import load_target

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dt = dtype_of(dtype)
    target, _ = load_target(model, device=device, dtype=dt)
    drafter, cfg = load_drafter(drafter_dir, device=device, dtype=dt)
    embed, head, _ = embedding_and_head(model, dtype=dt)
    embed, head = embed.to(device), head.to(device)
    stats = TauStats(name="responses", block_size=cfg.block_size)
    with torch.no_grad():
        for r in requests:
            seq = torch.tensor(r.prompt_ids + r.response_ids, device=device)
            hs = target(seq[None], output_hidden_states=True).hidden_states
            feats = tap_features(hs, cfg.target_layer_ids)
            start, end = len(r.prompt_ids), len(seq)
            L = accept_lengths(drafter, embed_VD=embed, lm_head_VD=head, input_ids_T=seq, hidden_TKD=feats,
                               start=start, end=end, mask_token_id=cfg.mask_token_id)
            stats.add(walk_accept_chain(L, start, end), end - start, r.sample_id)
    return stats
