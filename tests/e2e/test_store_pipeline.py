"""End to end with the cache on a real S3 server (SeaweedFS on localhost): `dflash extract --output s3://...`
-> `cache info/verify` -> `dflash train --cache s3://...` -> `dflash eval`, each command on a fresh local
mirror ($DFLASH_HOME, as on another machine); and the kill -9 / resume identity test of
test_extract_resume.py on the store: a run killed while publishing, resumed from another staging folder
(another machine), ends with exactly the content of an uninterrupted local run; and two torchrun agents on
localhost (two "nodes", c10d rendezvous, gloo on CPU), each with its own local scratch ($DFLASH_HOME),
sharing one cache on the store: `dflash extract` writes the same content as one local process, then
`dflash train` runs 2 DDP steps from the store on both nodes. One module: the server and the reference
extraction are made once for all three."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers_procs import stop
from store_server import s3_server  # noqa: F401  (fixture)
from test_extract_resume import COMMON, NUM_GOOD, _content, setup  # noqa: F401  (fixture + helpers)

from cli.main import cli
from dflash.procs import free_port
from dflash.store import protocol as sp
from dflash.store.objects import open_store
from dflash.store.sync import fetch_cache

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _env(server, home) -> dict:
    return {**server.env(), "DFLASH_HOME": str(home)}


def _invoke(monkeypatch, env, args):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    res = CliRunner().invoke(cli, args, prog_name="dflash")
    assert res.exit_code == 0, res.output + repr(res.exception)
    return res.output


def _records(url) -> int:
    return len(sp.classify_keys(open_store(url).list_keys()).records)


def test_extract_train_eval_on_the_store(setup, s3_server, tmp_path, monkeypatch):  # noqa: F811
    model, data, ref = setup
    url = s3_server.create_bucket("dflash-e2e") + "/runs/cache"
    out = _invoke(monkeypatch, _env(s3_server, tmp_path / "node-a"),
                  ["extract", "--model", model, "--data", data, "--output", url, *COMMON, "--gpus", "1",
                   "--no-progress"])
    assert f"{url}: published" in out and " MB/s), 0 already there" in out
    home_b = _env(s3_server, tmp_path / "node-b")  # every later command on a machine with no copy yet
    plan = _invoke(monkeypatch, home_b, ["extract", "--model", model, "--data", data, "--output", url, *COMMON,
                                         "--dry-run"])
    assert "shards committed on the store; the real run fetches them first" in plan
    (line,) = [ln for ln in plan.splitlines() if ln.startswith("store throughput:")]  # the probe vs the ETA
    assert re.search(r"[\d,]+ B/token written x \d+ ranks?; the store gave [\d,]+ MB/s \(8 x 4 MB PUT", line), line
    assert "the expected" in line and "tok/s per rank needs" in line
    assert not [k for k in open_store(url).list_keys() if k.startswith("_probe")]
    info = json.loads(_invoke(monkeypatch, home_b, ["cache", "info", url, "--json"]))
    assert info["samples"] == NUM_GOOD
    assert "ok:" in _invoke(monkeypatch, home_b, ["cache", "verify", url])
    home_c = _env(s3_server, tmp_path / "node-c")  # train and eval read the store directly: no local copy
    _invoke(monkeypatch, home_c, ["train", "--cache", url, "--model", model, "--output", str(tmp_path / "run"),
                                  "--config", "configs/train_tiny.yaml", "--steps", "2", "--device", "cpu"])
    res = json.loads(_invoke(monkeypatch, home_c, ["eval", "--drafter", str(tmp_path / "run" / "drafter"),
                                                   "--cache", url, "--model", model, "--approximate", "--json",
                                                   "--device", "cpu"]))
    assert res["overall"]["num_sequences"] == NUM_GOOD and res["tau"] >= 1.0
    assert not (tmp_path / "node-c" / "store").exists()
    mirrored = json.loads(_invoke(monkeypatch, home_c, ["eval", "--drafter", str(tmp_path / "run" / "drafter"),
                                                        "--cache", url, "--model", model, "--approximate",
                                                        "--json", "--device", "cpu", "--store-mirror"]))
    assert mirrored["overall"] == res["overall"] and (tmp_path / "node-c" / "store").is_dir()
    fetch_cache(url=url, local=str(tmp_path / "check"))
    assert _content(tmp_path / "check") == _content(ref)


def test_killed_extract_resumes_to_identical_content_on_the_store(setup, s3_server, tmp_path,  # noqa: F811
                                                                  monkeypatch):
    model, data, ref = setup
    url = s3_server.create_bucket("dflash-kill") + "/cache"
    args = ["extract", "--model", model, "--data", data, "--output", url, *COMMON, "--gpus", "1", "--no-progress"]
    env = {**os.environ, **_env(s3_server, tmp_path / "node-a")}
    p = subprocess.Popen([sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    deadline = time.monotonic() + 120
    while _records(url) < 2:
        assert p.poll() is None, f"run ended (rc={p.returncode}) before 2 shards were on the store"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait() == -signal.SIGKILL
    partial = _records(url)
    fetch_cache(url=url, local=str(tmp_path / "partial"))
    assert 0 < len(_content(tmp_path / "partial")) < NUM_GOOD, "the kill must land mid-run"

    out = _invoke(monkeypatch, _env(s3_server, tmp_path / "node-b"), args)  # another machine resumes
    assert f"{partial} shards already on the store" in out
    fetch_cache(url=url, local=str(tmp_path / "final"))
    assert _content(tmp_path / "final") == _content(ref)
    assert not sp.classify_keys(open_store(url).list_keys()).orphans
    manifest = json.loads(open_store(url).get("manifest.json"))
    assert manifest["totals"]["samples"] == NUM_GOOD


def test_the_machine_that_extracted_reads_the_cache_back(setup, s3_server, tmp_path, monkeypatch):  # noqa: F811
    """On the machine (and $DFLASH_HOME) of the extraction, killed with -9 mid-run and rerun: `cache verify URL`
    and `train` with and without --store-mirror read what the store holds. The extraction's staging folder,
    whose published shards were deleted, is no read-through mirror; a mirror lacking a shard fetches it."""
    import shutil

    from dflash.store.resolve import local_cache
    from dflash.store.url import mirror_folder

    model, data, ref = setup
    url = s3_server.create_bucket("dflash-home") + "/cache"
    home = tmp_path / "home"
    args = ["extract", "--model", model, "--data", data, "--output", url, *COMMON, "--gpus", "1", "--no-progress"]
    p = subprocess.Popen([sys.executable, "-m", "cli.main", *args], cwd=ROOT, env={**os.environ, **_env(s3_server, home)},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    deadline = time.monotonic() + 300
    while _records(url) < 2:
        assert p.poll() is None, f"run ended (rc={p.returncode}) before 2 shards were on the store"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    env = _env(s3_server, home)
    assert "shards already on the store" in _invoke(monkeypatch, env, args)  # the rerun, same machine
    assert "ok: " in _invoke(monkeypatch, env, ["cache", "verify", url])
    for extra in ([], ["--store-mirror"]):
        out = _invoke(monkeypatch, env, ["train", "--cache", url, "--model", model, "--output",
                                         str(tmp_path / f"run{len(extra)}"), "--config", "configs/train_tiny.yaml",
                                         "--steps", "2", "--device", "cpu", *extra])
        assert "trained 2 steps" in out
    mirror = Path(mirror_folder(url))
    shutil.rmtree(sorted((mirror / "shards").iterdir())[0])  # a shard gone from the mirror (by hand, a crash)
    assert local_cache(url) == str(mirror)
    assert _content(mirror) == _content(ref)


def _two_nodes(server, tmp_path, name, args, timeout=240, entry=("-m", "cli.main")):
    """Start `python -m torch.distributed.run --nnodes 2 ... ENTRY ARGS` twice, as node 0 and 1 (ENTRY: `-m
    cli.main`, or a script that runs it)."""
    port = free_port()
    procs = []
    for node in (0, 1):
        env = {**os.environ, **server.env(), "DFLASH_HOME": str(tmp_path / f"{name}-node{node}"),
               "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", name, *entry, *args]
        log = open(tmp_path / f"{name}-node{node}.log", "wb")
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    for p, log in procs:
        rc = p.wait(timeout=timeout)
        log.close()
        assert rc == 0, Path(log.name).read_text()[-4000:]
    return [Path(log.name).read_text() for _, log in procs]


def test_two_node_extract_and_train_share_one_store_cache(setup, s3_server, tmp_path,  # noqa: F811
                                                          monkeypatch):
    model, data, ref = setup
    url = s3_server.create_bucket("dflash-nodes") + "/cache"
    # rank 1's last publish is held back 3 s, so rank 0 is done first: it must keep the lease until rank 1 is
    _two_nodes(s3_server, tmp_path, "extract", ["extract", "--model", model, "--data", data, "--output", url,
                                                *COMMON, "--no-progress"],
               entry=(str(Path(__file__).with_name("slow_last_publish.py")),))
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    fetch_cache(url=url, local=str(tmp_path / "check"))
    content = _content(tmp_path / "check")
    assert content == _content(ref)
    assert {p.name[:5] for p in (tmp_path / "check" / "shards").iterdir()} == {"r0000", "r0001"}  # both ranks
    assert len(content) == NUM_GOOD
    logs = _two_nodes(s3_server, tmp_path, "train", [
        "train", "--cache", url, "--model", model, "--output", str(tmp_path / "run"),
        "--config", "configs/train_tiny.yaml", "--steps", "2", "--device", "cpu"])
    assert "trained 2 steps" in "".join(logs)
    assert (tmp_path / "run" / "drafter" / "config.json").exists()


def _staged_bytes(home: Path) -> int:
    """Bytes of shard data in the staging folder(s) under a DFLASH_HOME (committed shards and shards being
    written; not the commit logs or the stored tokenization)."""
    total = 0
    for d in home.glob("store/*"):
        for sub in ("shards", "_staging"):
            for root, _, files in os.walk(d / sub):  # the publisher deletes shards meanwhile
                for f in files:
                    try:
                        total += os.stat(os.path.join(root, f)).st_size
                    except FileNotFoundError:
                        pass
    return total


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process so far (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_watching(cmd, env, home, *, until=None, timeout=300, **popen):
    """Start cmd; poll the staging size every 10 ms until it exits or until() holds. Returns (proc, max bytes)."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, **{"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE,
                                                    "text": True, **popen})
    most, deadline = 0, time.monotonic() + timeout
    while p.poll() is None and not (until and until()):
        assert time.monotonic() < deadline, "extraction did not finish in time"
        most = max(most, _staged_bytes(home))
        time.sleep(0.01)
    return p, most


def test_a_run_whose_lease_is_taken_stops_and_the_staging_folder_stays_bounded(setup, s3_server, tmp_path,  # noqa: F811
                                                                                monkeypatch):
    """Another run takes the lease over mid-run (as a run that judged it stale would): this one stops within
    seconds with one line naming the new holder, commits nothing after it noticed, and a rerun resumes from
    the same staging folder (whose published shards were deleted) to the reference content. Throughout, the
    staging folder holds only shards in flight while the store ends with all of them."""
    from dflash.store.lease import Lease
    from dflash.extract.to_store import STAGED_SHARDS

    model, data, ref = setup
    url = s3_server.create_bucket("dflash-steal") + "/cache"
    args = ["extract", "--model", model, "--data", data, "--output", url, *COMMON, "--gpus", "1", "--no-progress"]
    home = tmp_path / "node-a"
    env = {**os.environ, **_env(s3_server, home)}
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    store = open_store(url)
    # SIGINT ignored, as in a background job of a script (`bash scripts/test.sh &`): the run must stop anyway
    log = open(tmp_path / "stopped.err", "w+")  # a file: a pipe nobody reads while polling could fill up
    p, most = _run_watching([sys.executable, "-m", "cli.main", *args], env, home, until=lambda: _records(url) >= 2,
                            preexec_fn=_ignore_sigint, stderr=log)
    assert p.poll() is None, f"run ended (rc={p.returncode}) before 2 shards were on the store"
    stop(p)  # no shard commits between the two counts below
    now = time.time()
    store.put(sp.LEASE_KEY, Lease(owner="other-job", host="node-thief", pid=4242, purpose="dflash extract",
                                  acquired=now, renewed=now, ttl_s=300.0).to_bytes())
    seen, cpu_at_steal = _records(url), _cpu_seconds(p.pid)
    p.send_signal(signal.SIGCONT)
    # promptness in the run's own CPU seconds, not wall time: on a loaded machine (2 cores, load ~10) a second
    # of wall time may be a tenth of a CPU second. The run reads the lease every second (LEASE_CHECK_EVERY).
    cpu, deadline = cpu_at_steal, time.monotonic() + 300  # a hang guard, not a timing
    try:
        while p.poll() is None:
            assert time.monotonic() < deadline, "the run did not stop after its lease was taken"
            with contextlib.suppress(OSError, IndexError, ValueError):
                cpu = _cpu_seconds(p.pid)
            time.sleep(0.02)
    finally:
        if p.poll() is None:
            p.kill()
    log.seek(0)
    err = log.read()
    log.close()
    assert p.returncode == 1, err[-3000:]
    assert cpu - cpu_at_steal < 8, f"the run used {cpu - cpu_at_steal:.1f} CPU s after its lease was taken"
    (line,) = [ln for ln in err.splitlines() if "lost the extraction lease" in ln]
    assert "held by PID 4242 on host node-thief" in line and "rerun this command" in line, line
    stopped = _records(url)
    assert stopped <= seen + 1  # at most the pass that was between its lease check and its records
    print(f"lease test: {cpu - cpu_at_steal:.2f} CPU s from the takeover to the exit; {seen} -> {stopped} records")
    fetch_cache(url=url, local=str(tmp_path / "partial"))
    assert 0 < len(_content(tmp_path / "partial")) < NUM_GOOD, "the run stopped before its end"

    store.delete([sp.LEASE_KEY])  # that other run is over: rerun on the same machine and staging folder
    done, sizes = threading.Event(), [0]

    def watch() -> None:  # the rerun runs here, on the main thread (as the CLI does); this one measures
        while not done.wait(0.01):
            sizes[0] = max(sizes[0], _staged_bytes(home))
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        out = _invoke(monkeypatch, _env(s3_server, home), args)
    finally:
        done.set()
        watcher.join()
    most_rerun = sizes[0]
    assert f"{stopped} shards already on the store" in out
    fetch_cache(url=url, local=str(tmp_path / "final"))
    assert _content(tmp_path / "final") == _content(ref)
    per_shard: dict[str, int] = {}
    for key, n in store.list_sizes("shards/"):
        per_shard[key.split("/")[1]] = per_shard.get(key.split("/")[1], 0) + n
    assert len(per_shard) == len(sp.classify_keys(store.list_keys()).records) > 3 * (STAGED_SHARDS + 2)
    # the writer waits while it holds more than STAGED_SHARDS committed shards the store lacks: at most those,
    # the one it just committed and the one it writes (at the rerun's start: what the stopped run left)
    assert max(most, most_rerun) <= (STAGED_SHARDS + 2) * max(per_shard.values())
    assert not list(home.glob("store/*/shards/*"))  # every shard published and deleted locally
