import os

# Two cores on CI: keep torch from oversubscribing when tests spawn worker processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M as an HF folder, converted once per machine ($DFLASH_HOME or ~/.cache/dflash)."""
    from dflash.target.assets import smollm2_hf_dir

    return smollm2_hf_dir()
