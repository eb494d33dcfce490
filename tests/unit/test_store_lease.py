"""The extraction lease of a cache URL (dflash.store.lease): the stale-lease rules as a pure function, and the
lease on a real S3 server (SeaweedFS on localhost): a second run gets one line, dead or expired holders are
taken over by version, a run that lost its lease knows it, and `dflash extract` refuses a held URL."""

import json
import socket
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from store_server import s3_env, s3_server  # noqa: F401  (fixtures)

from dflash.errors import LockedError
from dflash.store import protocol as sp
from dflash.store.lease import (LEASE_TTL, RENEW_EVERY, ExtractLease, Lease, judge_lease, job_owner_id, read_lease,
                                wait_for_job_lease)
from dflash.store.objects import open_store

HOST = "node-a"
NOW = 1_000_000.0


def lease(**kw) -> Lease:
    d = dict(owner="job-a", host=HOST, pid=42, purpose="dflash extract", acquired=NOW - 100, renewed=NOW - 10,
             ttl_s=300.0)
    return Lease(**{**d, **kw})


@pytest.mark.parametrize("found, alive, kind", [
    (None, None, "free"),
    (lease(), True, "held"),                                   # a live run on this host
    (lease(), False, "stale"),                                 # killed on this host: at once
    (lease(owner="job-b", pid=7), False, "mine"),              # our own job's (a rerun of the rendezvous)
    (lease(owner="job-b", renewed=NOW - 999), None, "mine"),
    (lease(host="node-b"), None, "held"),                      # another host, renewed 10 s ago
    (lease(host="node-b", renewed=NOW - 301), None, "stale"),  # another host, not renewed for its ttl
    (lease(host="node-b", renewed=NOW - 300), None, "held"),   # exactly at the ttl: not yet
    (lease(renewed=NOW - 301), True, "stale"),                 # alive but hung: renewals stopped
])
def test_judge_lease_rules(found, alive, kind):
    v = judge_lease(found, owner="job-b", host=HOST, now=NOW, holder_pid_alive=alive)
    assert v.kind == kind, v.reason
    assert v.reason


def test_job_owner_id_is_one_per_torchrun_job_and_fresh_per_process():
    job = {"TORCHELASTIC_RUN_ID": "x", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert job_owner_id({**job, "RANK": "0"}) == job_owner_id({**job, "RANK": "7"})
    assert job_owner_id(job) != job_owner_id({**job, "MASTER_PORT": "29501"})
    assert job_owner_id({}) != job_owner_id({})


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def put_lease(store, **kw) -> None:
    now = time.time()
    d = dict(owner="someone-else", host="node-b", pid=1, purpose="dflash extract --output there",
             acquired=now - 50, renewed=now - 5, ttl_s=LEASE_TTL)
    store.put(sp.LEASE_KEY, Lease(**{**d, **kw}).to_bytes())


def test_second_run_gets_one_line_and_stale_holders_are_taken_over(s3_env, tmp_path):
    url = s3_env.create_bucket("dflash-lease") + "/c"
    store = open_store(url)
    a = ExtractLease(store, owner="job-a", purpose="dflash extract --output " + url).acquire()
    assert read_lease(store)[0].owner == "job-a" and sp.classify_keys(store.list_keys()).has_lease
    with pytest.raises(LockedError) as err:
        ExtractLease(store, owner="job-b", purpose="x").acquire()
    text = str(err.value)
    assert "\n" not in text and f"{url} is being extracted by PID" in text and socket.gethostname() in text
    assert f"delete {url}/{sp.LEASE_KEY}" in text
    a.release()
    assert read_lease(store) is None

    put_lease(store, host=socket.gethostname(), pid=dead_pid())     # killed -9 on this host
    ExtractLease(store, owner="job-c", purpose="x").acquire()
    assert read_lease(store)[0].owner == "job-c"
    put_lease(store, renewed=time.time() - LEASE_TTL - 5)           # another host's, expired
    ExtractLease(store, owner="job-d", purpose="x").acquire()
    assert read_lease(store)[0].owner == "job-d"


def test_takeover_is_by_version_and_a_run_that_lost_its_lease_is_told(s3_env):
    url = s3_env.create_bucket("dflash-lease-race") + "/c"
    store = open_store(url)
    put_lease(store, renewed=time.time() - LEASE_TTL - 5)
    stale_tag = store.get_tagged(sp.LEASE_KEY)[1]
    b = ExtractLease(store, owner="job-b", purpose="x").acquire()   # B judged it stale first
    assert store.put_if(sp.LEASE_KEY, b"late", e_tag=stale_tag) is None  # A's takeover of that version fails
    with pytest.raises(LockedError, match="is being extracted by"):
        ExtractLease(store, owner="job-a", purpose="x").acquire()  # A re-reads: B's live lease
    b.renew_if_due(now=time.time() + RENEW_EVERY + 1)
    assert read_lease(store)[0].renewed > read_lease(store)[0].acquired
    put_lease(store, owner="job-z")                                  # someone replaced B's lease
    with pytest.raises(LockedError, match="lost the extraction lease"):
        b.renew_if_due(now=time.time() + 2 * RENEW_EVERY + 2)
    b.release()
    assert read_lease(store)[0].owner == "job-z"                    # B does not delete another run's lease


def test_context_manager_and_the_other_ranks_wait(s3_env):
    url = s3_env.create_bucket("dflash-lease-ranks") + "/c"
    store = open_store(url)
    with pytest.raises(LockedError, match="rank 0 did not take"):
        wait_for_job_lease(store, owner="job-a", timeout=0.6)
    with ExtractLease(store, owner="job-a", purpose="x") as held:
        wait_for_job_lease(store, owner="job-a", timeout=5)
        with pytest.raises(LockedError, match="is being extracted by"):
            wait_for_job_lease(store, owner="job-b", timeout=5)
        held.check()
    assert read_lease(store) is None


def test_extract_refuses_a_url_another_live_run_holds(s3_env, tmp_path, smollm2_dir, monkeypatch):
    url = s3_env.create_bucket("dflash-lease-cli") + "/c"
    put_lease(open_store(url), host="node-b")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    from cli.main import cli
    res = CliRunner().invoke(cli, ["extract", "--model", str(smollm2_dir), "--data", str(data), "--output", url,
                                   "--gpus", "1", "--no-progress"])
    assert res.exit_code == 1, res.output
    assert f"{url} is being extracted by PID 1 on host node-b" in res.output
    assert not (tmp_path / "home" / "store").exists()  # refused before any staging or store write
    assert [k for k in open_store(url).list_keys()] == [sp.LEASE_KEY]
