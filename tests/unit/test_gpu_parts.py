"""Files too large for one device call travel in parts: scripts/split_parts.sh splits, benchmarks/h200_assets.sh
stashes the parts each call carried and joins them (weed_joined: the xz-compressed SeaweedFS binary, put on PATH;
gguf_joined: the GGUF). Real scripts in bash on small files, the device's calls played in folders of their own."""

from __future__ import annotations

import hashlib
import lzma
import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def split(src: pathlib.Path, name: str, out: pathlib.Path) -> list[str]:
    env = dict(os.environ, PART_SIZE="1K", PARTS_DIR=str(out))
    subprocess.run(["bash", str(ROOT / "scripts" / "split_parts.sh"), str(src), name], check=True, env=env,
                   capture_output=True)
    assert (out / f"{name}.sha256").read_text().strip() == hashlib.sha256(src.read_bytes()).hexdigest()
    return sorted(p.name for p in out.glob(f"{name}.part-*"))


def device_call(tmp: pathlib.Path, call: str, parts: list[pathlib.Path], script: str) -> subprocess.CompletedProcess:
    """One call on the warm machine: a tree that carries `parts` in .assets/, then `script` after the stash step,
    with $HOME (where the stash lives) kept across calls."""
    tree = tmp / call
    (tree / ".assets").mkdir(parents=True)
    for p in parts:
        (tree / ".assets" / p.name).write_bytes(p.read_bytes())
    return subprocess.run(["bash", "-c", f". {ROOT}/benchmarks/h200_assets.sh && stash_parts && {script}"],
                          cwd=tree, env=dict(os.environ, HOME=str(tmp / "home")), capture_output=True, text=True)


def test_weed_parts_across_two_calls_join_into_a_binary_on_path(tmp_path):
    # a stand-in for the weed binary: a runnable script, with random hex so that its xz spans 3 parts of 1 KiB
    weed = b"#!/bin/sh\n# " + os.urandom(2500).hex().encode() + b'\necho "fake weed $1"\n'
    xz = tmp_path / "weed.xz"
    xz.write_bytes(lzma.compress(weed))
    names = split(xz, "weed.xz", tmp_path / "parts")
    assert names == ["weed.xz.part-a", "weed.xz.part-b", "weed.xz.part-c"]
    parts = [tmp_path / "parts" / n for n in names]
    join = f"WEED_SHA256={hashlib.sha256(weed).hexdigest()} && weed_joined && weed version"

    first = device_call(tmp_path, "call1", parts[:1], join)
    assert first.returncode == 1
    assert first.stderr.strip().count("\n") == 0  # one line, naming what to carry and what makes it
    assert "weed.xz.part-a" in first.stderr and ".assets/weed.xz.part-*" in first.stderr
    assert "scripts/split_weed.sh" in first.stderr
    assert not (tmp_path / "home" / "dflash_assets" / "bin" / "weed").exists()

    second = device_call(tmp_path, "call2", parts[1:], join)
    assert second.returncode == 0, second.stderr
    assert "weed.xz parts on this machine: weed.xz.part-a weed.xz.part-b weed.xz.part-c" in second.stdout
    assert second.stdout.strip().endswith("fake weed version")
    assert (tmp_path / "home" / "dflash_assets" / "bin" / "weed").read_bytes() == weed


def test_gguf_parts_join_through_the_same_rule(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(2500))
    parts = [tmp_path / "parts" / n for n in split(gguf, "smollm2.gguf", tmp_path / "parts")]
    assert len(parts) == 3
    done = device_call(tmp_path, "call", parts,
                       f"GGUF_SHA256={hashlib.sha256(gguf.read_bytes()).hexdigest()} && gguf_joined")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "home" / "dflash_assets" / "smollm2.gguf").read_bytes() == gguf.read_bytes()


def test_checkpoint_parts_and_regenerations_stashed_for_later_calls(tmp_path):
    """The stretch's calls: one with the whole tree stashes the committed regenerations, so that later calls carry
    a slim tree (slim_tree.sh out) and find them put back in it; carried checkpoint parts (.assets/ref_ckpt) are
    stashed like SpecForge's."""
    tree = tmp_path / "call1"
    (tree / "benchmarks" / "assets" / "quality").mkdir(parents=True)
    for name in ("sharegpt_whole-00.jsonl.gz", "sharegpt_sampled_t0.8_s2-00.jsonl.gz"):
        (tree / "benchmarks" / "assets" / "quality" / name).write_bytes(name.encode())
    (tree / ".assets" / "ref_ckpt").mkdir(parents=True)
    for name in ("run_all_int4.tar.part-000", "run_all_int4.tar.manifest.json"):
        (tree / ".assets" / "ref_ckpt" / name).write_text(name)
    env = dict(os.environ, HOME=str(tmp_path / "home"))
    done = subprocess.run(["bash", "-c", f". {ROOT}/benchmarks/h200_assets.sh && stash_parts"], cwd=tree, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "ref_ckpt: checkpoint parts on this machine: 1" in done.stdout
    stash = tmp_path / "home" / "dflash_assets"
    assert sorted(p.name for p in (stash / "quality").iterdir()) == ["sharegpt_sampled_t0.8_s2-00.jsonl.gz",
                                                                    "sharegpt_whole-00.jsonl.gz"]
    assert (stash / "ref_ckpt" / "run_all_int4.tar.part-000").read_text() == "run_all_int4.tar.part-000"
    slim = tmp_path / "call2" / "benchmarks" / "assets" / "quality"   # a slim tree: the greedy files only
    slim.mkdir(parents=True)
    (slim / "sharegpt_whole-00.jsonl.gz").write_bytes(b"sharegpt_whole-00.jsonl.gz")
    again = subprocess.run(["bash", "-c", f". {ROOT}/benchmarks/h200_assets.sh && stash_parts"], cwd=tmp_path / "call2",
                           env=env, capture_output=True, text=True)
    assert again.returncode == 0 and len(list((stash / "quality").iterdir())) == 2
    # the stashed sampled regeneration is back where the tree keeps it, for the stages that read it there
    assert (slim / "sharegpt_sampled_t0.8_s2-00.jsonl.gz").read_bytes() == b"sharegpt_sampled_t0.8_s2-00.jsonl.gz"
