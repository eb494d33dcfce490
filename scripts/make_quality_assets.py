"""Write the prompt assets of benchmarks/bench_quality.py into .assets/ (git-ignored) for the GPU machine, which has
none of the asset packages: .assets/sharegpt_prompts.jsonl (the first user turns of the first N usable ShareGPT
conversations), .assets/mtbench_question.jsonl (MT-Bench question.jsonl), .assets/HumanEval.jsonl.gz, and
.assets/sharegpt_heldout_prompts.jsonl (bench_reference's held-out ShareGPT eval set: first user turns from the end
of the package that no training conversation holds as a user turn; --heldout-from names the training data), and
.assets/sharegpt_users.jsonl.gz (every conversation of the package with its user turns and each assistant turn
blanked to "."; the input of whole-conversation regeneration on the GPU machine, benchmarks/run_h200_generate.sh,
which regenerates every assistant turn: 4.5 MiB instead of the package's ~90 MiB of original answers).

Usage: python scripts/make_quality_assets.py [--count 4000] [--max-chars 2000] [--out .assets]
           [--heldout-count 244] [--heldout-from TRAIN.jsonl[.gz] ...]
"""

from __future__ import annotations

import argparse
import gzip
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


def user_turns(paths) -> set[str]:
    """Every user message (stripped) of conversation files: what a held-out prompt must not be."""
    from dflash.data import iter_records

    out: set[str] = set()
    for path in paths:
        for rec in iter_records(path):
            out.update(m["content"].strip() for m in getattr(rec, "messages", None) or () if m["role"] == "user")
    return out


def prompt_texts(path) -> set[str]:
    """The user turns (stripped) of a prompt file of write_jsonl's {"messages": [user turn]} records (the readers
    skip records with no assistant turn, so they are read here line by line)."""
    with open(path, encoding="utf-8") as f:
        return {m["content"].strip() for line in f if line.strip()
                for m in json.loads(line)["messages"] if m["role"] == "user"}


def last_distinct(texts: list[str], *, count: int, exclude: set[str], max_chars: int) -> list[str]:
    """Up to `count` texts taken from the end of `texts` (file order), skipping empty ones, ones over max_chars,
    ones in `exclude` and repeats (ShareGPT holds the same prompt in several conversations: 32 of the last 244
    first turns are also first turns of the first 13K conversations), returned in file order."""
    picked: list[str] = []
    seen: set[str] = set()
    for text in reversed(texts):
        if len(picked) == count:
            break
        if not text or len(text) > max_chars or text in exclude or text in seen:
            continue
        seen.add(text)
        picked.append(text)
    return picked[::-1]


def heldout_first_turns(count: int, *, max_chars: int, exclude: set[str]) -> list[dict]:
    """{"messages": [first user turn]} records for bench_reference's held-out ShareGPT set (last_distinct over the
    package's first user turns). A text that is a user turn of more than one conversation of the package is not
    picked: ShareGPT repeats "continue", "hi" and pasted prompts, and the reference run trains without every
    conversation that holds a held-out prompt (the first pick of 244 would have removed 1,037 conversations,
    545 of them for "continue" alone)."""
    from collections import Counter

    from dflash.data import iter_records
    from dflash.data.assets import sharegpt_path

    firsts, uses = [], Counter()
    for rec in iter_records(sharegpt_path()):
        msgs = getattr(rec, "messages", None) or []
        firsts.append(msgs[0]["content"].strip() if msgs and msgs[0]["role"] == "user" else "")
        uses.update({m["content"].strip() for m in msgs if m["role"] == "user"})
    repeated = {t for t, n in uses.items() if n > 1}
    return [{"messages": [{"role": "user", "content": t}]}
            for t in last_distinct(firsts, count=count, exclude=exclude | repeated, max_chars=max_chars)]


def users_only() -> list[dict]:
    """Every usable ShareGPT conversation as {"id", "messages"} with each assistant turn's content replaced by "."
    (`dflash generate` regenerates them; the placeholder keeps the turn structure the readers expect)."""
    from dflash.data import iter_records
    from dflash.data.assets import sharegpt_path

    out: list[dict] = []
    for index, rec in enumerate(iter_records(sharegpt_path())):
        msgs = getattr(rec, "messages", None)
        if not msgs:
            continue
        out.append({"id": f"sharegpt-{index}",
                    "messages": [m if m["role"] != "assistant" else {"role": "assistant", "content": "."}
                                 for m in msgs]})
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
    ap.add_argument("--heldout-count", type=int, default=244, help="held-out ShareGPT eval prompts to write")
    ap.add_argument("--heldout-from", nargs="+", default=[],
                    help="training conversation files whose user turns the held-out prompts must avoid")
    args = ap.parse_args()
    from dflash.data.assets import humaneval_path, mtbench_questions_path

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = first_user_turns(args.count, max_chars=args.max_chars)
    write_jsonl(out / "sharegpt_prompts.jsonl", prompts)
    shutil.copyfile(mtbench_questions_path(), out / "mtbench_question.jsonl")
    shutil.copyfile(humaneval_path(), out / "HumanEval.jsonl.gz")
    heldout = heldout_first_turns(args.heldout_count, max_chars=args.max_chars, exclude=user_turns(args.heldout_from))
    write_jsonl(out / "sharegpt_heldout_prompts.jsonl", heldout)
    users = users_only()
    tmp = out / "sharegpt_users.jsonl.gz.tmp"
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in users)
    os.replace(tmp, out / "sharegpt_users.jsonl.gz")
    for name in ("sharegpt_prompts.jsonl", "mtbench_question.jsonl", "HumanEval.jsonl.gz",
                 "sharegpt_heldout_prompts.jsonl", "sharegpt_users.jsonl.gz"):
        print(f"{out / name}: {(out / name).stat().st_size / 2**20:.2f} MiB")
    print(f"{len(prompts)} ShareGPT prompts, {len(heldout)} held-out ShareGPT prompts "
          f"(none a user turn of {len(args.heldout_from)} training file(s))")


if __name__ == "__main__":
    main()
