"""docs/results.md is what benchmarks/report.py renders from benchmarks/results/*.json (CI fails when stale)."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_report"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_results_page_is_up_to_date():
    run = subprocess.run([sys.executable, "benchmarks/report.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr + run.stdout


def test_check_fails_on_a_stale_page(report, tmp_path, monkeypatch):
    page = tmp_path / "results.md"
    page.write_text(report.build().replace("2.332", "2.333", 1))
    monkeypatch.setattr(report, "PAGE", page)
    assert report.main(["--check"]) == 1
    page.unlink()
    assert report.main(["--check"]) == 1  # a missing page is stale too
    assert report.main([]) == 0 and report.main(["--check"]) == 0


def test_templates_read_the_json(report):
    data = {"a": {"b.c": [1.23456, 2]}, "runs": [{"tok_s": 9216.2}], "reading": "x (3) tail"}
    assert report.render("{a[b.c][0]:.2f} and {runs[0].tok_s:,.0f}", data) == "1.23 and 9,216"
    assert report.render("{=j('a[b.c][0]')*2:.1f}; {=join(j('a[b.c]'), '.1f')}", data) == "2.5; 1.2, 2.0"
    with pytest.raises(KeyError):
        report.render("{a.missing}", data)


def test_commands_name_no_machine_paths(report):
    cmd = ("/opt/torch/.venv/bin/python3 benchmarks/bench_x.py --gguf /root/dflash_assets/smollm2.gguf "
           "--out /root/out/x.json --model /root/.cache/dflash/smollm2 --peer /work/main/.peer/sf")
    assert report.clean_command(cmd) == ("python3 benchmarks/bench_x.py --gguf $ASSETS/smollm2.gguf --out $OUT/x.json "
                                         "--model $DFLASH_HOME/smollm2 --peer .peer/sf")
    import re
    for page in ["README.md", "CONTRIBUTING.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]:
        text = (ROOT / page).read_text()
        found = re.findall(r"(?<![\w.$])(?:/work/|/root/|\.\./shared)\S*", text)
        assert not found, f"{page} names machine paths: {found[:3]}"


def _figure_values(results: str) -> dict[str, str]:
    """Figure id -> its value and baseline cells, from docs/results.md."""
    out = {}
    for block in results.split('<a id="')[1:]:
        fid, rest = block.split('"', 1)
        cells = [line for line in rest.splitlines() if line.startswith(("| value |", "| baseline |", "| note |"))]
        out[fid] = " ".join(cells)
    return out


def test_readme_results_come_from_the_results_page():
    import re
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Results\n(.*?)(?=^## )", readme, flags=re.M | re.S).group(1)
    figures = _figure_values((ROOT / "docs" / "results.md").read_text())
    rows = [line for line in section.splitlines() if "docs/results.md#" in line]
    assert len(rows) >= 5, "the README's Results table links no figures"
    for row in rows:
        fid = re.search(r"docs/results\.md#([\w-]+)", row).group(1)
        assert fid in figures, f"README links docs/results.md#{fid}, which the page does not have"
        cells = row.split("|")[2:]  # the figure and baseline cells (the first cell names the row)
        for number in re.findall(r"\d[\d,]*\.?\d*", " ".join(cells)):
            assert number.rstrip(".") in figures[fid], f"README's {number} is not in docs/results.md#{fid}"
