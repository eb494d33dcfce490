"""benchmarks/README.md lists every script of benchmarks/ (common.py is the scripts' shared code; the modules of
benchmarks/peer/ belong to bench_peer's row), and no one-off probe script is left."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
INDEX = (ROOT / "benchmarks" / "README.md").read_text()


def test_every_script_is_in_the_index():
    scripts = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))
    missing = [name for name in scripts if f"`{name}`" not in INDEX and name != "common.py"]
    assert not missing, f"benchmarks/README.md does not list {missing}"


def test_no_probe_scripts_are_left():
    assert not sorted((ROOT / "benchmarks").glob("probe_*.py"))
