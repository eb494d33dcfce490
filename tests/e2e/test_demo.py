"""`run_demo` end to end with tiny settings on the real SmolLM2-135M and ShareGPT: every step runs through the
library (extract, train, generate, extract, eval), the table and DIR/demo_result.json come out, and a rerun in the
same folder reuses the finished steps.

At this scale (a handful of conversations, a few steps) the trained drafter is not expected to beat the untrained
one, so that is not asserted: `bash scripts/demo.sh` (CPU preset) is where trained > untrained shows (README.md).
"""

import json

import pytest

from dflash.demo import RESULT_FILE, cpu_defaults, run_demo
from dflash.errors import ConfigError

pytestmark = pytest.mark.slow

TINY = dict(conversations=6, max_length=256, steps=3, num_anchors=8, block_size=4, batch_tokens=1024,
            eval_prompts=2, max_new_tokens=12)


def test_demo_end_to_end_and_resume(tmp_path, smollm2_dir, monkeypatch):
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    cfg = cpu_defaults(output=str(tmp_path / "demo"), **TINY)
    lines: list[str] = []
    res = run_demo(cfg, echo=lines.append)
    out = tmp_path / "demo"

    saved = json.loads((out / RESULT_FILE).read_text())
    assert [r["drafter"] for r in saved["rows"]] == ["untrained", "trained"]
    for r in saved["rows"]:
        assert r["tau"] >= 1.0 and r["accepted_per_step"] >= 0.0
        assert r["sequences"] == 2 and r["exact"] is True
    assert set(saved["step_seconds"]) == {"convert", "extract_train", "train", "generate", "extract_eval", "eval"}
    assert saved["config"]["steps"] == 3

    text = "\n".join(lines)
    assert "=== [1/7]" in text and "=== [7/7]" in text
    assert res.table in text
    header, *rows = res.table.splitlines()
    assert "tau (MT-Bench)" in header and "accepted/step" in header and "samples" in header
    assert [row.split()[0] for row in rows] == ["untrained", "trained"]
    assert (out / "train_run" / "drafter" / "model.safetensors").is_file()
    assert (out / "untrained_drafter" / "model.safetensors").is_file()
    assert len((out / "conversations.jsonl").read_text().splitlines()) == 6
    assert len((out / "mtbench_greedy.jsonl").read_text().splitlines()) == 2

    # a rerun with the same settings reuses every finished step and gives the same numbers
    again = run_demo(cfg, echo=lines.append)
    assert [r["tau"] for r in again.rows] == [r["tau"] for r in saved["rows"]]
    assert "0 to extract" in "\n".join(lines[len(lines) // 2:])
    # other settings in the same folder are refused, naming the field
    with pytest.raises(ConfigError, match="steps=3"):
        run_demo(cpu_defaults(output=str(out), **{**TINY, "steps": 4}), echo=lines.append)
