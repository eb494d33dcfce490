"""Where dflash keeps its own files (converted test models, weight hashes, store mirrors): one rule, read by
the target assets, the target identity cache and the store's mirror folders."""

from __future__ import annotations

import os
from pathlib import Path


def dflash_home() -> Path:
    """$DFLASH_HOME, else ~/.cache/dflash."""
    return Path(os.environ.get("DFLASH_HOME") or Path.home() / ".cache" / "dflash")
