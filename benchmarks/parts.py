"""A training checkpoint across GPU sessions (SpecForge's in bench_peer, dflash's in bench_reference): packed as a
tar into parts small enough to come back through $OUT (<= 16 MiB a file, 8 files / 64 MiB a call) and to be carried
in again (the working tree and what a call carries: 64 MiB), a manifest with sha256 of every part and of the whole,
and the accounting of a run trained in segments. Pure functions over files and dicts (no torch).

    python benchmarks/parts.py missing MANIFEST DIR   # parts of MANIFEST not (or not intact) in DIR
    python benchmarks/parts.py batches MANIFEST DIR   # the missing ones grouped per return call
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import tarfile

PART_BYTES = 15 * 2**20
"""A part's size: under the 16 MiB a file may have to come back, and one part fits a call's ~20 MiB of payload."""
CALL_FILES, CALL_BYTES = 7, 60 * 2**20
"""What one call may bring back beside its result JSON (8 files, 64 MiB in all)."""


class PartsError(ValueError):
    """Parts that do not make the file their manifest names (one line: which part, what is wrong)."""


def sha256_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def split_file(src: pathlib.Path, out_dir: pathlib.Path, *, part_bytes: int = PART_BYTES, **meta) -> dict:
    """Split `src` into out_dir/NAME.part-000, -001, ... of `part_bytes` (the last one shorter) and write
    out_dir/NAME.manifest.json: {file, bytes, sha256, parts: [{name, bytes, sha256}], **meta}. Returns it."""
    if part_bytes < 1:
        raise ValueError(f"part_bytes={part_bytes}: must be >= 1")
    src, out_dir = pathlib.Path(src), pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    whole, parts = hashlib.sha256(), []
    with open(src, "rb") as f:
        while True:
            chunk = f.read(part_bytes)
            if not chunk and parts:
                break
            whole.update(chunk)
            name = f"{src.name}.part-{len(parts):03d}"
            (out_dir / name).write_bytes(chunk)
            parts.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
            if len(chunk) < part_bytes:
                break
    manifest = {"file": src.name, "bytes": sum(p["bytes"] for p in parts), "sha256": whole.hexdigest(),
                "parts": parts, **meta}
    manifest_path(out_dir, src.name).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def manifest_path(folder: pathlib.Path, file: str) -> pathlib.Path:
    return pathlib.Path(folder) / f"{file}.manifest.json"


def missing_parts(manifest: dict, folder: pathlib.Path) -> list[str]:
    """The parts of `manifest` that `folder` lacks or holds with another size or sha256, in order."""
    folder = pathlib.Path(folder)
    out = []
    for p in manifest["parts"]:
        f = folder / p["name"]
        if not f.is_file() or f.stat().st_size != p["bytes"] or sha256_file(f) != p["sha256"]:
            out.append(p["name"])
    return out


def join_parts(manifest: dict, folder: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """Join the parts in `folder` into `dest`, each part and the whole checked against the manifest."""
    missing = missing_parts(manifest, folder)
    if missing:
        raise PartsError(f"{len(missing)} of {len(manifest['parts'])} parts of {manifest['file']} are missing or "
                         f"damaged in {folder}: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    dest = pathlib.Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "wb") as out:
        for p in manifest["parts"]:
            out.write((pathlib.Path(folder) / p["name"]).read_bytes())
    got = sha256_file(tmp)
    if got != manifest["sha256"]:
        tmp.unlink()
        raise PartsError(f"the joined {manifest['file']} has sha256 {got[:12]}..., the manifest {manifest['sha256'][:12]}...")
    tmp.replace(dest)
    return dest


def pack_tar(members: dict[str, pathlib.Path], tar: pathlib.Path, dest: pathlib.Path, **meta) -> dict:
    """Files and folders (name in the tar -> path) as the tar `tar`, split into parts in `dest` (split_file, `meta`
    in the manifest); the tar itself removed. Returns the manifest."""
    tar = pathlib.Path(tar)
    try:
        with tarfile.open(tar, "w") as tf:
            for name, path in members.items():
                tf.add(path, arcname=name)
        return split_file(tar, dest, **meta)
    finally:
        tar.unlink(missing_ok=True)


def unpack_tar(manifest: dict, folder: pathlib.Path, into: pathlib.Path) -> None:
    """The tar of `manifest`, joined from its parts in `folder` (join_parts: each part and the whole checked),
    unpacked into `into`; the joined tar removed."""
    into = pathlib.Path(into)
    into.mkdir(parents=True, exist_ok=True)
    tar = join_parts(manifest, folder, into / manifest["file"])
    try:
        with tarfile.open(tar) as tf:
            tf.extractall(into, filter="data")
    finally:
        tar.unlink()


def batches(manifest: dict, names: list[str] | None = None, *, max_files: int = CALL_FILES,
            max_bytes: int = CALL_BYTES) -> list[list[str]]:
    """`names` (default every part), in order, grouped into calls of at most max_files files and max_bytes."""
    size = {p["name"]: p["bytes"] for p in manifest["parts"]}
    out: list[list[str]] = []
    for name in names if names is not None else list(size):
        if size[name] > max_bytes:
            raise PartsError(f"{name}: {size[name]} bytes, more than a call brings back ({max_bytes})")
        if not out or len(out[-1]) >= max_files or sum(size[n] for n in out[-1]) + size[name] > max_bytes:
            out.append([])
        out[-1].append(name)
    return out


def save_interval(*, seqs_per_step: int, seqs_per_s: float, seconds: float) -> int:
    """SpecForge's --save-interval (micro-steps) for a checkpoint every ~`seconds` of training: a multiple of the
    accumulation steps (a checkpoint between two optimizer steps would drop the gradient accumulated so far)."""
    steps = max(1, round(seqs_per_s * seconds / seqs_per_step))
    return steps * seqs_per_step


def segment_totals(segments: list[dict]) -> dict:
    """The wall time of a run trained in segments (each {start_step, end_step, startup_s, train_s, lost_s}: the
    micro-steps it covered, the seconds before training began, those from then to its last kept checkpoint (or
    to its end), those after that checkpoint, thrown away by the cut). The run's own wall time is the first
    segment's start-up (a run that is never cut has it too) plus every segment's training; the restarts' start-up
    and the lost work are the cost of cutting it, kept apart. Segments must follow each other without a gap."""
    if not segments:
        raise ValueError("no segments")
    for a, b in zip(segments, segments[1:]):
        if b["start_step"] != a["end_step"]:
            raise ValueError(f"segment starting at micro-step {b['start_step']} does not continue the one that "
                             f"ended at {a['end_step']}")
    train = sum(s["train_s"] for s in segments)
    return {"wall_s": round(segments[0]["startup_s"] + train, 2), "train_s": round(train, 2),
            "restart_overhead_s": round(sum(s["startup_s"] for s in segments[1:]) + sum(s["lost_s"] for s in segments), 2),
            "micro_steps": segments[-1]["end_step"] - segments[0]["start_step"], "segments": len(segments)}


def totals_on_card(segments: list[dict], card: str) -> dict | None:
    """segment_totals as if every segment had trained on `card`, for a time comparison with a run on that card
    when the sessions of a segmented run got different cards (each segment records its `card`; one without is
    taken as on `card`). The other cards' segments' training is their micro-steps at the rate `card`'s segments
    measured (micro-steps per second of training, all of them together); the first start-up is kept whatever its
    card (process start, loading, data preparation). None when no segment trained on `card`."""
    totals = segment_totals(segments)
    other = [s for s in segments if s.get("card", card) != card]
    if not other:
        return {**totals, "card": card}
    same = [s for s in segments if s.get("card", card) == card and s["train_s"] > 0]
    if not same:
        return None
    rate = sum(s["end_step"] - s["start_step"] for s in same) / sum(s["train_s"] for s in same)
    estimated = sum((s["end_step"] - s["start_step"]) / rate for s in other)
    train = sum(s["train_s"] for s in same) + estimated
    return {**totals, "wall_s": round(segments[0]["startup_s"] + train, 2), "train_s": round(train, 2),
            "card": card, "micro_steps_per_s": round(rate, 3), "estimated_train_s": round(estimated, 2),
            "segments_on_other_cards": len(other),
            "measured_wall_s": totals["wall_s"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["missing", "batches"])
    ap.add_argument("manifest")
    ap.add_argument("folder")
    a = ap.parse_args(argv)
    manifest = json.loads(pathlib.Path(a.manifest).read_text())
    missing = missing_parts(manifest, pathlib.Path(a.folder))
    if a.what == "missing":
        print("\n".join(missing) if missing else f"all {len(manifest['parts'])} parts of {manifest['file']} are here")
    else:
        for i, b in enumerate(batches(manifest, missing)):
            print(f"call {i + 1}: {' '.join(b)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
