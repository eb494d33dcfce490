"""Issue 19 on the training side, with real processes, caches and a real tmpfs: one `dflash train` per run
folder, a resume reads the cache it started on, a full disk while checkpointing, a cache still being written."""

import logging
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from train_helpers import tiny_cache, tiny_config, tiny_target  # noqa: E402

from dflash.errors import CacheMismatchError, OutOfSpaceError  # noqa: E402
from dflash.train.checkpoint import list_checkpoints  # noqa: E402
from dflash.train.metrics import read_metrics  # noqa: E402
from dflash.train.trainer import train  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("safety")
    target = tiny_target(d / "target")
    return str(target), str(tiny_cache(d / "cache", target, num_samples=12)), d


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")


def _losses(run):
    return [x for r in read_metrics(run) for x in r["step_losses"]]


def test_second_train_on_one_output_fails_at_once_naming_the_holder(assets, tmp_path):
    model, cache, _ = assets
    run = tmp_path / "run"
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
        from train_helpers import tiny_config
        from dflash.train.trainer import train
        train(tiny_config(cache={cache!r}, model={model!r}, output={str(run)!r}, steps=100000, save_every=1000),
              device="cpu")
    """)
    env = dict(os.environ, DFLASH_NO_PROGRESS="1")
    first = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        deadline = time.time() + 90
        while not (run / "metrics.jsonl").exists():
            assert first.poll() is None, "the first run exited"
            assert time.time() < deadline, "the first run logged nothing in 90 s"
            time.sleep(0.05)
        t0 = time.time()
        second = subprocess.run([sys.executable, "-m", "cli.main", "train", "--cache", cache, "--model", model,
                                 "--output", str(run), "--device", "cpu", "--steps", "3", "--resume"],
                                env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1, second.stdout + second.stderr
        err = [line for line in second.stderr.splitlines() if line.startswith("Error")]
        assert len(err) == 1 and f"PID {first.pid} on host {socket.gethostname()}" in err[0], second.stderr
        assert "Traceback" not in second.stderr
        assert time.time() - t0 < 60  # at once: refused before loading anything heavy or training
        assert first.poll() is None  # the holder is untouched
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    steps = [r["step"] for r in read_metrics(run)]
    assert steps == sorted(set(steps))  # one writer: no step logged twice


def test_resume_with_another_cache_is_refused_naming_the_field(assets, tmp_path):
    model, cache, d = assets
    kw = dict(model=model, steps=6, save_every=2)
    run = tmp_path / "run"
    train(tiny_config(cache=cache, output=str(run), stop_after_steps=2, **kw), device="cpu")
    fewer = tiny_cache(tmp_path / "fewer", pathlib.Path(model), num_samples=10)  # same fingerprint, other data
    with pytest.raises(CacheMismatchError, match="the checkpoint's cache totals.samples 12 != the --cache's 10"):
        train(tiny_config(cache=str(fewer), output=str(run), **kw), resume=True, device="cpu")
    fp8 = tiny_cache(tmp_path / "fp8", pathlib.Path(model), num_samples=12, storage="fp8")
    with pytest.raises(CacheMismatchError, match="the checkpoint's cache storage 'bf16' != the --cache's 'fp8'"):
        train(tiny_config(cache=str(fp8), output=str(run), **kw), resume=True, device="cpu")
    moved = tmp_path / "moved"
    shutil.copytree(cache, moved)  # the same cache at another path resumes
    assert train(tiny_config(cache=str(moved), output=str(run), **kw), resume=True, device="cpu").finished


def test_full_disk_while_checkpointing_is_one_error_and_resumes_once_freed(assets, tmp_path):
    """The run folder on a real 4 MiB tmpfs, filled until a checkpoint cannot fit: OutOfSpaceError naming the
    path and the free space, no tmp file left, and the same command with --resume finishes once space is freed,
    with the losses of an uninterrupted run."""
    model, cache, _ = assets
    kw = dict(cache=cache, model=model, steps=4, save_every=2, keep_checkpoints=1)
    ref = tmp_path / "ref"
    train(tiny_config(output=str(ref), **kw), device="cpu")
    size = list_checkpoints(ref)[-1].stat().st_size
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs here: {mounted.stderr!r}")
    try:
        assert size < 1 << 20, size
        free = shutil.disk_usage(mnt).free
        filler = mnt / "filler"
        filler.write_bytes(b"\0" * (free - size // 2))  # room for config.json and metrics, not for a checkpoint
        run = mnt / "run"
        with pytest.raises(OutOfSpaceError, match=r"no space left .*step-00000002\.pt .*MiB free.*--resume") as e:
            train(tiny_config(output=str(run), **kw), device="cpu")
        assert str(run / "checkpoints") in str(e.value) and "\n" not in str(e.value)
        assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]  # tmp file removed
        filler.unlink()
        res = train(tiny_config(output=str(run), **kw), resume=True, device="cpu")
        assert res.finished and _losses(run) == _losses(ref)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_training_on_a_cache_being_written_warns(assets, tmp_path, caplog):
    from dflash.locks import FolderLock

    model, cache, _ = assets
    with FolderLock(cache, purpose="dflash extract --output test"):  # a live extraction's run lock
        with caplog.at_level(logging.WARNING, logger="dflash.train.setup"):
            train(tiny_config(cache=cache, model=model, output=str(tmp_path / "r"), steps=1), device="cpu")
    msg = [r.getMessage() for r in caplog.records if "still being written" in r.getMessage()]
    assert len(msg) == 1 and f"PID {os.getpid()}" in msg[0] and "12 samples committed" in msg[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash.train.setup"):
        train(tiny_config(cache=cache, model=model, output=str(tmp_path / "r2"), steps=1), device="cpu")
    assert not [r for r in caplog.records if "still being written" in r.getMessage()]


def test_second_sweep_on_one_output_fails_at_once(assets, tmp_path):
    model, cache, _ = assets
    out = tmp_path / "sw"
    spec = tmp_path / "spec.yaml"
    spec.write_text("base: {num_layers: 1, block_size: 4, num_anchors: 8, batch_tokens: 200, intermediate_size: 64, "
                    "steps: 100000, save_every: 1000, log_every: 1}\n")
    env = dict(os.environ, DFLASH_NO_PROGRESS="1")
    args = [sys.executable, "-m", "cli.main", "sweep", str(spec), "--cache", cache, "--model", model,
            "--output", str(out), "--device", "cpu"]
    first = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 90
        while not (out / "runs" / "run" / "metrics.jsonl").exists():
            assert first.poll() is None, "the first sweep exited"
            assert time.time() < deadline, "the first sweep logged nothing in 90 s"
            time.sleep(0.05)
        second = subprocess.run(args + ["--resume"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1, second.stdout + second.stderr
        err = [line for line in second.stderr.splitlines() if line.startswith("Error")]
        assert len(err) == 1 and f"PID {first.pid} on host {socket.gethostname()}" in err[0], second.stderr
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
