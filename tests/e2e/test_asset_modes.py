"""The converted SmolLM2 folder is readable like any other file the process writes (issue 19: its
model.safetensors was 0600 while the rest was 0644): a real GGUF conversion into a fresh folder."""

import os
import stat


def test_converted_smollm2_respects_the_umask(tmp_path):
    from dflash.target.assets import smollm2_hf_dir

    old = os.umask(0o022)
    try:
        dest = smollm2_hf_dir(tmp_path, dtype="bfloat16")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in dest.iterdir()}
    assert "model.safetensors" in modes
    assert set(modes.values()) == {0o644}, modes
    assert stat.S_IMODE(dest.stat().st_mode) == 0o755
