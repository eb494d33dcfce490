"""Two torchrun agents on localhost (two "nodes", c10d rendezvous, gloo on CPU), each with its own local
scratch ($DFLASH_HOME), sharing one cache on the SeaweedFS S3 server: `dflash extract` writes the same content
as one local process, then `dflash train` runs 2 DDP steps from the store on both nodes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from store_server import s3_server  # noqa: F401  (fixture)
from test_extract_resume import COMMON, NUM_GOOD, _content, setup  # noqa: F401  (fixture + helpers)

from dflash.procs import free_port
from dflash.store.sync import fetch_cache

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _two_nodes(server, tmp_path, name, args, timeout=240):
    """Start `python -m torch.distributed.run --nnodes 2 ... -m cli.main ARGS` twice, as node 0 and 1."""
    port = free_port()
    procs = []
    for node in (0, 1):
        env = {**os.environ, **server.env(), "DFLASH_HOME": str(tmp_path / f"{name}-node{node}"),
               "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", name, "-m", "cli.main", *args]
        log = open(tmp_path / f"{name}-node{node}.log", "wb")
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    for p, log in procs:
        rc = p.wait(timeout=timeout)
        log.close()
        assert rc == 0, Path(log.name).read_text()[-4000:]
    return [Path(log.name).read_text() for _, log in procs]


def test_two_node_extract_and_train_share_one_store_cache(setup, s3_server, tmp_path):  # noqa: F811
    model, data, ref = setup
    url = s3_server.create_bucket("dflash-nodes") + "/cache"
    _two_nodes(s3_server, tmp_path, "extract", ["extract", "--model", model, "--data", data, "--output", url,
                                                *COMMON, "--no-progress"])
    for k, v in s3_server.env().items():
        os.environ[k] = v
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
