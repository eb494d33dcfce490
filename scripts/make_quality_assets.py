"""Write the prompt assets of benchmarks/bench_quality.py into .assets/ (git-ignored) for the GPU machine, which has
none of the asset packages: .assets/sharegpt_prompts.jsonl (the first user turns of the first N usable ShareGPT
conversations), .assets/mtbench_question.jsonl (MT-Bench question.jsonl) and .assets/HumanEval.jsonl.gz.

Usage: python scripts/make_quality_assets.py [--count 4000] [--max-chars 2000] [--out .assets]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil


def first_user_turns(count: int, *, max_chars: int) -> list[dict]:
    """{"messages": [first user turn]} of the first `count` ShareGPT records whose first turn is a user message
    of 1..max_chars characters (long pastes would dominate the generation time of a small benchmark)."""
    from dflash.data import iter_records
    from dflash.data.assets import sharegpt_path

    out: list[dict] = []
    for rec in iter_records(sharegpt_path()):
        msgs = getattr(rec, "messages", None)
        if not msgs or msgs[0]["role"] != "user":
            continue
        text = msgs[0]["content"].strip()
        if not text or len(text) > max_chars:
            continue
        out.append({"messages": [{"role": "user", "content": text}]})
        if len(out) == count:
            break
    return out


def write_jsonl(path: pathlib.Path, records: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=4000, help="ShareGPT prompts to write")
    ap.add_argument("--max-chars", type=int, default=2000, help="skip first turns longer than this")
    ap.add_argument("--out", default=".assets", help="output folder")
    args = ap.parse_args()
    from dflash.data.assets import humaneval_path, mtbench_questions_path

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = first_user_turns(args.count, max_chars=args.max_chars)
    write_jsonl(out / "sharegpt_prompts.jsonl", prompts)
    shutil.copyfile(mtbench_questions_path(), out / "mtbench_question.jsonl")
    shutil.copyfile(humaneval_path(), out / "HumanEval.jsonl.gz")
    for name in ("sharegpt_prompts.jsonl", "mtbench_question.jsonl", "HumanEval.jsonl.gz"):
        print(f"{out / name}: {(out / name).stat().st_size / 2**20:.2f} MiB")
    print(f"{len(prompts)} ShareGPT prompts")


if __name__ == "__main__":
    main()
