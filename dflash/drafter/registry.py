"""Drafter architectures by name: which config class and module a run, a checkpoint or a config.json builds.

One entry per method (STYLE 24): `dflash` (the paper's drafter, z-lab DFlashDraftModel) and `dflash2` (DFlash 2,
DFlash2DraftModel). Training picks by TrainConfig.arch, a checkpoint by its drafter config's `arch` key (absent in
DFlash checkpoints), a drafter folder by config.json `architectures`.
"""

from __future__ import annotations

from typing import Any

from dflash.drafter.config import ARCHITECTURE, DrafterConfig
from dflash.drafter.dflash2 import ARCHITECTURE2, DFlash2Config, DFlash2Drafter
from dflash.drafter.model import DFlashDrafter
from dflash.errors import ConfigError

ARCHS = {"dflash": (DrafterConfig, DFlashDrafter, ARCHITECTURE),
         "dflash2": (DFlash2Config, DFlash2Drafter, ARCHITECTURE2)}
"""arch name -> (config class, module class, config.json architecture). dflash.train.config.ARCHS lists the
names again without importing torch (the CLI's --help); a test holds the two equal."""


def arch_of(cfg: DrafterConfig) -> str:
    """The arch name of a drafter config (the most derived class registered)."""
    for name, (cls, _, _) in ARCHS.items():
        if type(cfg) is cls:
            return name
    raise ConfigError(f"{type(cfg).__name__}: not a registered drafter config")


def build_drafter(cfg: DrafterConfig) -> DFlashDrafter:
    """The (freshly initialised) drafter module of this config's architecture."""
    return ARCHS[arch_of(cfg)][1](cfg)


def config_from_json(d: dict[str, Any]) -> DrafterConfig:
    """Inverse of DrafterConfig.to_json (checkpoints): the `arch` key picks the class (absent = dflash)."""
    d = dict(d)
    arch = d.pop("arch", "dflash")
    if arch not in ARCHS:
        raise ConfigError(f"drafter config arch={arch!r}: choose one of {list(ARCHS)}")
    d["target_layer_ids"] = tuple(d["target_layer_ids"])
    return ARCHS[arch][0](**d)


def config_from_hf(hf: dict[str, Any]) -> DrafterConfig:
    """Parse a drafter config.json by its `architectures`; ConfigError names the problem."""
    archs = (hf.get("architectures") or []) if isinstance(hf, dict) else []
    for _, (cls, _, hf_arch) in reversed(ARCHS.items()):
        if hf_arch in archs:
            return cls.from_hf_config(hf)
    return DrafterConfig.from_hf_config(hf)  # names the expected architecture
