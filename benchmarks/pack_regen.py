"""Pack the committed records of a `dflash generate` job as text-only conversations, in gzip files small enough
to come back from the GPU machine (its $OUT takes files of at most 16 MiB, 8 per call).

The job's records carry the exact token ids (input_ids, loss_mask, response ids); these are dropped here, so a
packed file is training data that extraction tokenizes again with the chat template (a training cache need not
be target-greedy; an eval cache is never made from a packed file). Reads the merged output when the job has
finished, else the shards its commit log lists, in chunk order, so a job cut at a device call's time limit
brings back everything committed so far.

    python benchmarks/pack_regen.py OUTPUT.jsonl.gz DEST_DIR [--max-mib 15] [--prefix regen]
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib


def committed_files(output: pathlib.Path) -> list[pathlib.Path]:
    """The merged output if it exists, else the committed shards in chunk order."""
    if output.is_file():
        return [output]
    parts = output.parent / (output.name + ".parts")
    if not (parts / "commits.jsonl").is_file():
        return []  # no chunk committed yet
    lines = [json.loads(s) for s in (parts / "commits.jsonl").read_text().splitlines() if s.strip()]
    lines.sort(key=lambda c: c["chunk"])
    return [parts / "shards" / c["file"] for c in lines]


def text_record(rec: dict) -> dict:
    return {"id": rec.get("id"), "messages": rec["messages"]}


def pack(output: pathlib.Path, dest: pathlib.Path, *, max_bytes: int, prefix: str) -> list[tuple[str, int]]:
    dest.mkdir(parents=True, exist_ok=True)
    written: list[tuple[str, int]] = []
    index, count, out, raw = 0, 0, None, 0
    for path in committed_files(output):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                if out is None:
                    name = f"{prefix}-{index:02d}.jsonl.gz"
                    out, raw, count = gzip.open(dest / name, "wt", encoding="utf-8", compresslevel=9), 0, 0
                text = json.dumps(text_record(json.loads(line)), ensure_ascii=False) + "\n"
                out.write(text)
                raw += len(text.encode())
                count += 1
                # gzip of this text is ~4x smaller; cut at 3.5x the limit of raw bytes to stay well under it
                if raw > 3.5 * max_bytes:
                    out.close()
                    written.append((name, count))
                    out, index = None, index + 1
    if out is not None:
        out.close()
        written.append((name, count))
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output", type=pathlib.Path, help="the job's --output path")
    ap.add_argument("dest", type=pathlib.Path)
    ap.add_argument("--max-mib", type=float, default=15.0)
    ap.add_argument("--prefix", default="regen")
    args = ap.parse_args()
    written = pack(args.output, args.dest, max_bytes=int(args.max_mib * 2**20), prefix=args.prefix)
    for name, n in written:
        size = (args.dest / name).stat().st_size
        print(f"{name}: {n} conversations, {size / 2**20:.1f} MiB")
    print(json.dumps({"files": [{"name": n, "records": c} for n, c in written],
                      "records": sum(c for _, c in written)}))


if __name__ == "__main__":
    main()
