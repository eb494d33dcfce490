"""dflash.compiled.compile_wanted: the one rule for the compile_elementwise settings of extraction and training."""

import pytest

from dflash.compiled import compile_wanted, target_compiles
from dflash.errors import ConfigError
from dflash.extract.driver import ExtractConfig


@pytest.mark.parametrize(("setting", "device", "want"), [
    ("auto", "cuda", True), ("auto", "cuda:3", True), ("auto", "cpu", False),
    ("on", "cpu", True), ("on", "cuda", True), ("off", "cuda", False), ("off", "cpu", False)])
def test_compile_wanted(setting, device, want):
    assert compile_wanted(setting, device) is want


def test_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="choose auto, on or off"):
        compile_wanted("yes", "cuda")
    with pytest.raises(ConfigError, match="compile_elementwise='yes'"):
        ExtractConfig(model="m", data=("d.jsonl",), output="o", compile_elementwise="yes")
    with pytest.raises(ConfigError, match="compile_layers='yes'"):
        ExtractConfig(model="m", data=("d.jsonl",), output="o", compile_layers="yes")
    assert ExtractConfig(model="m", data=("d.jsonl",), output="o").compile_layers == "off"


@pytest.mark.parametrize(("elementwise", "layers", "device", "want"), [
    ("auto", "off", "cuda", (True, False)), ("auto", "on", "cuda", (False, True)),
    ("auto", "auto", "cuda", (False, True)), ("auto", "auto", "cpu", (False, False)),
    ("on", "auto", "cpu", (True, False)), ("off", "off", "cuda", (False, False))])
def test_target_compiles_layers_replace_the_chains(elementwise, layers, device, want):
    assert target_compiles(elementwise, layers, device) == want
