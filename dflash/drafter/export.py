"""Write and read an HF-format drafter directory: config.json + model.safetensors + dflash.py.

The layout is that of the published z-lab drafters, so SGLang / vLLM / z-lab `DFlashDraftModel` load what
we export and we load theirs. dflash.py, the module config.json's auto_map names, is a verbatim copy of
modeling_dflash.py (torch + transformers only), so `AutoModel.from_pretrained(folder, trust_remote_code=True)`
loads the drafter where dflash is not installed. Export is atomic: everything is written and fsynced in a temporary sibling
directory that is renamed into place, so a crash never leaves a half-written drafter behind.
Tradeoff: the whole state dict is materialised on the CPU once (about 3.5 GB in bf16 for the 27B drafter).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash.drafter.config import AUTO_MAP, DrafterConfig
from dflash.drafter.model import DFlashDrafter
from dflash.drafter.registry import build_drafter, config_from_hf
from dflash.dtypes import dtype_name
from dflash.durable import apply_umask, fsync_dir, refuse_nonempty
from dflash.errors import ConfigError, ModelNotFoundError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MODELING_NAME = AUTO_MAP["AutoModel"].split(".")[0] + ".py"
"""The remote-code module auto_map names ("dflash.py")."""
MODELING_TEMPLATE = Path(__file__).with_name("modeling_dflash.py")
"""Its source, copied verbatim."""


def export_drafter(model: DFlashDrafter, cfg: DrafterConfig, out_dir: str | os.PathLike, *,
                   dtype: torch.dtype = torch.bfloat16, overwrite: bool = False,
                   dflash_extra: Mapping[str, Any] | None = None) -> Path:
    """Write `model` as an HF drafter folder at out_dir; returns its path.

    Refuses an existing non-empty out_dir unless overwrite=True, in which case the old folder is replaced
    only after the new one is complete. dflash_extra: more config.json dflash_config fields (how the drafter
    was trained, e.g. train.prefix.objective_config_fields); loaders ignore them.
    """
    out = Path(out_dir)
    if not overwrite:
        refuse_nonempty(out, what="export directory",
                        remedy="choose another --output folder, or pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    hf = cfg.to_hf_config()
    hf["dtype"] = dtype_name(dtype)
    hf["dflash_config"].update(dflash_extra or {})
    state = {name: t.detach().to(device="cpu", dtype=dtype).contiguous()
             for name, t in model.state_dict().items()}
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        with open(tmp / CONFIG_NAME, "w") as f:
            json.dump(hf, f, indent=2, sort_keys=True)
            f.write("\n")
        written = [WEIGHTS_NAME, CONFIG_NAME]
        if "auto_map" in hf:  # the module auto_map names (a DFlash 2 config names none: engines build it)
            shutil.copyfile(MODELING_TEMPLATE, tmp / MODELING_NAME)
            written.append(MODELING_NAME)
        for name in written:
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        apply_umask(tmp)   # safetensors writes 0600 and mkdtemp makes 0700: readable like any other file
        fsync_dir(tmp)
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
        os.replace(tmp, out)
        fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_drafter_config(path: str | os.PathLike) -> DrafterConfig:
    """The DrafterConfig of a drafter folder; ModelNotFoundError if it is not one."""
    p = Path(path)
    cfg_path = p / CONFIG_NAME
    if not cfg_path.is_file():
        raise ModelNotFoundError(f"{str(p)!r} is not a drafter folder: no {CONFIG_NAME}")
    try:
        hf = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelNotFoundError(f"{str(cfg_path)!r} is not valid JSON: {e}") from e
    try:
        return config_from_hf(hf)
    except ConfigError as e:
        raise ModelNotFoundError(f"{str(p)!r} is not a usable DFlash drafter: {e}") from e


def load_drafter(path: str | os.PathLike, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None) -> tuple[DFlashDrafter, DrafterConfig]:
    """Load a drafter folder (ours or a published one). dtype None keeps the stored dtype."""
    p = Path(path)
    cfg = read_drafter_config(p)
    weights = p / WEIGHTS_NAME
    if not weights.is_file():
        raise ModelNotFoundError(f"{str(p)!r} has a drafter config but no {WEIGHTS_NAME}")
    with torch.device("meta"):
        model = build_drafter(cfg)
    expected = set(model.state_dict())
    state = {}
    with safe_open(str(weights), framework="pt", device=str(device)) as f:
        found = set(f.keys())
        missing, unexpected = sorted(expected - found), sorted(found - expected)
        if missing or unexpected:
            raise ModelNotFoundError(
                f"{str(weights)!r} does not match the drafter config: missing {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                f"{' ...' if len(unexpected) > 5 else ''}")
        for name in expected:
            state[name] = f.get_tensor(name)
    if dtype is None:
        dtype = next(iter(state.values())).dtype
    for name, t in state.items():
        state[name] = t.to(dtype)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:   # shape mismatch between config.json and the weights
        raise ModelNotFoundError(f"{str(weights)!r} does not match its config.json: {e}") from e
    return model.to(device), cfg
