"""Read only the target's token embedding and LM head from its safetensors checkpoint.

The drafter shares both, frozen (DFlash paper 4.2). For Qwen3.5-27B they are 2 x 1.27 GB of a 54 GB
checkpoint, so we open only the shard(s) that hold them (model.safetensors.index.json `weight_map`) and
read just those tensors with `safe_open`. Handles tied embeddings (no lm_head tensor: the head is the
embedding, SpecForge PR #473 is the bug this avoids) and multimodal prefixes (`model.language_model.`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.errors import ModelNotFoundError

EMBED_KEYS = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "model.language_model.model.embed_tokens.weight",
)
HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight", "model.language_model.lm_head.weight")


@dataclass(frozen=True, kw_only=True)
class HeadInfo:
    """Where the embedding and head came from."""

    vocab_size: int
    """Rows of the embedding (the checkpoint's padded vocab, >= the tokenizer's)."""
    hidden_size: int
    """Columns of the embedding."""
    tied: bool
    """True when the LM head is the embedding (config says so, or the checkpoint has no head tensor)."""
    embed_key: str
    """Tensor name of the embedding in the checkpoint."""
    lm_head_key: str | None
    """Tensor name of the LM head, None when tied and absent."""
    shards: tuple[str, ...]
    """The safetensors files that were opened (all other shards were not touched)."""


def _weight_map(model_dir: Path) -> dict[str, str]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = model_dir / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {k: single.name for k in f.keys()}
    raise ModelNotFoundError(f"{model_dir} has no model.safetensors or model.safetensors.index.json")


def _config_tied(model_dir: Path) -> bool | None:
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        return None
    cfg = json.loads(cfg_path.read_text())
    for c in (cfg.get("text_config") or {}, cfg):
        if "tie_word_embeddings" in c:
            return bool(c["tie_word_embeddings"])
    return None


def _fetch(path: str, filename: str) -> Path:
    """Local file, or a single hub download of exactly that file."""
    if os.path.isdir(path):
        return Path(path) / filename
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(path, filename))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, auth
        raise ModelNotFoundError(f"cannot fetch {filename} of {path} from the hub: {e}") from e


def embedding_and_head(
    path: str | os.PathLike, *, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, HeadInfo]:
    """Embedding [V, D] and LM head [V, D] of the target checkpoint at `path` (CPU tensors).

    `dtype` casts both (None keeps the stored dtype). When tied, the head is the same tensor object.
    """
    from safetensors import safe_open

    from dflash.target.load import local_model_dir

    src = os.fspath(path)
    model_dir = local_model_dir(src)  # raises ModelNotFoundError
    weight_map = _weight_map(model_dir)
    embed_key = next((k for k in EMBED_KEYS if k in weight_map), None)
    if embed_key is None:
        raise ModelNotFoundError(f"no token embedding in {src}; looked for {list(EMBED_KEYS)}")
    head_key = next((k for k in HEAD_KEYS if k in weight_map), None)
    config_tied = _config_tied(model_dir)
    if head_key is None and config_tied is False:
        raise ModelNotFoundError(f"{src}: config says tie_word_embeddings=false but the checkpoint has no lm_head")
    tied = head_key is None or bool(config_tied)

    wanted = {embed_key: None} if tied else {embed_key: None, head_key: None}
    shards = sorted({weight_map[k] for k in wanted})
    for shard in shards:
        file = _fetch(src, shard) if not os.path.isdir(src) else model_dir / shard
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in wanted:
                if weight_map[key] == shard:
                    wanted[key] = f.get_tensor(key)
    embed_VD = wanted[embed_key]
    head_VD = embed_VD if tied else wanted[head_key]
    if dtype is not None:
        embed_VD = embed_VD.to(dtype)
        head_VD = embed_VD if tied else head_VD.to(dtype)
    if head_VD.shape != embed_VD.shape:
        raise ModelNotFoundError(
            f"{src}: LM head {tuple(head_VD.shape)} and embedding {tuple(embed_VD.shape)} differ in shape"
        )
    info = HeadInfo(vocab_size=embed_VD.shape[0], hidden_size=embed_VD.shape[1], tied=tied,
                    embed_key=embed_key, lm_head_key=None if tied else head_key, shards=tuple(shards))
    return embed_VD, head_VD, info
