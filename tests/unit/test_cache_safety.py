"""Crash safety (SIGKILL), corruption, ENOSPC, fingerprint mismatch, concurrent ranks, and the CLI."""

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cli.main import cli
from dflash.cache import CacheReader, CacheWriter, Fingerprint, committed_sample_ids
from dflash.cache import shardfile
from dflash.errors import CacheFormatError, CacheMismatchError, OutOfSpaceError

D, TAPS, N_SAMPLES = 32, (1, 4, 7), 60

# Writes samples 0..N-1 (of this rank) that are not committed yet, a few per append, then exits.
# Sample data is a pure function of the id, so the parent can check every byte.
WRITER = textwrap.dedent("""
    import sys, numpy as np, torch
    sys.path.insert(0, {root!r})
    from tests.unit.test_cache_safety import fp, sample, N_SAMPLES
    from dflash.cache import CacheWriter, committed_sample_ids
    from dflash.cache.commit import open_cache_fingerprint
    path, rank, nranks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    done = committed_sample_ids(path) if open_cache_fingerprint(path) else set()
    todo = [i for i in range(N_SAMPLES) if i % nranks == rank and i not in done]
    with CacheWriter(path, fp(), rank=rank, shard_tokens=64, queue_depth=2) as w:
        print("started", flush=True)
        for k in range(0, len(todo), 3):
            ids = todo[k:k + 3]
            s = [sample(i) for i in ids]
            w.append(sample_ids=np.array(ids), lengths=np.array([len(x[0]) for x in s]),
                     input_ids=np.concatenate([x[0] for x in s]), loss_mask=np.concatenate([x[1] for x in s]),
                     hidden=torch.cat([x[2] for x in s]))
""")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fp(**kw):
    d = dict(target="m", target_config_hash="h", num_target_layers=8, hidden_size=D, target_dtype="bfloat16",
             tokenizer_hash="t", chat_template_hash="c", tap_layer_ids=TAPS, storage="bf16")
    d.update(kw)
    return Fingerprint(**d)


def sample(i):
    rng = np.random.default_rng(i)
    L = 1 + (i * 7919) % 37
    return (rng.integers(0, 1000, L).astype(np.int32), rng.integers(0, 2, L).astype(np.uint8),
            torch.from_numpy(rng.standard_normal((L, len(TAPS), D)).astype(np.float32)).to(torch.bfloat16))


def check_cache(path, expect_all=False):
    r = CacheReader(path)
    ids = committed_sample_ids(path)
    assert set(r.index.sample_id.tolist()) == ids
    assert r.manifest["totals"]["samples"] <= len(ids)
    for j in range(len(r)):
        s = r.read(j)
        ref = sample(s.sample_id)
        assert np.array_equal(s.input_ids, ref[0]) and np.array_equal(s.loss_mask, ref[1])
        assert torch.equal(s.hidden, ref[2])
    if expect_all:
        assert ids == set(range(N_SAMPLES))
    return ids


def spawn(path, rank=0, nranks=1):
    return subprocess.Popen([sys.executable, "-c", WRITER.format(root=ROOT), str(path), str(rank), str(nranks)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigkill_at_random_moments_then_resume(tmp_path):
    rnd = random.Random(0)
    t_end = time.monotonic() + 18
    trials = 0
    while trials < 4 or time.monotonic() < t_end:  # 4 kills even when a loaded machine starts python slowly
        p = spawn(tmp_path)
        line = p.stdout.readline()
        time.sleep(rnd.uniform(0, 0.6))
        p.send_signal(signal.SIGKILL)
        p.wait()
        trials += 1
        if "started" not in line:
            raise AssertionError(p.stderr.read())
        check_cache(tmp_path)  # opens, committed samples exact, nothing uncommitted visible
    p = spawn(tmp_path)
    assert p.wait(timeout=60) == 0, p.stderr.read()
    check_cache(tmp_path, expect_all=True)
    result = CliRunner().invoke(cli, ["cache", "verify", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert trials >= 4
    assert not os.listdir(tmp_path / "_staging")


def test_two_ranks_write_one_cache_concurrently(tmp_path):
    procs = [spawn(tmp_path, rank, 2) for rank in (0, 1)]
    for p in procs:
        assert p.wait(timeout=60) == 0, p.stderr.read()
    check_cache(tmp_path, expect_all=True)
    assert sorted(os.listdir(tmp_path / "commits")) == ["rank-0.jsonl", "rank-1.jsonl"]
    result = CliRunner().invoke(cli, ["cache", "verify", str(tmp_path)])
    assert result.exit_code == 0, result.output


def write_small(path, ids, **kw):
    s = [sample(i) for i in ids]
    with CacheWriter(path, fp(), shard_tokens=40, **kw) as w:
        w.append(sample_ids=np.array(ids), lengths=np.array([len(x[0]) for x in s]),
                 input_ids=np.concatenate([x[0] for x in s]), loss_mask=np.concatenate([x[1] for x in s]),
                 hidden=torch.cat([x[2] for x in s]))
    return w


def test_flipped_byte_fails_verify_and_read(tmp_path):
    write_small(tmp_path, list(range(8)))
    r = CacheReader(tmp_path)
    j = 5
    shard = r.index.shard_names[r.index.shard[j]]
    f = tmp_path / "shards" / shard / "hidden" / "c" / "0" / "0" / "0"
    data = bytearray(f.read_bytes())
    # a byte inside tap 1's first chunk of sample j (hidden is written tap-major)
    from dflash.cache.shardfile import ArrayFile
    a = ArrayFile.open(str(tmp_path / "shards" / shard / "hidden"), "x")
    c = r.index.offset[j] // a.chunk_shape[0]
    lin = np.ravel_multi_index((c, 1, 0), a.grid)
    data[int(a.index[lin, 0]) + 3] ^= 0x10
    f.write_bytes(bytes(data))
    result = CliRunner().invoke(cli, ["cache", "verify", str(tmp_path)])
    assert result.exit_code == 1
    assert f"shard {shard} array hidden chunk ({c}, 1, 0)" in result.output
    with pytest.raises(CacheFormatError, match=f"shard {shard} array hidden chunk"):
        CacheReader(tmp_path).read(j)
    CacheReader(tmp_path).read(j, taps=[1])  # other taps are intact and still readable


def test_enospc_raises_and_keeps_committed_cache(tmp_path, monkeypatch):
    write_small(tmp_path, list(range(6)))
    before = check_cache(tmp_path)
    real = shardfile.os.writev
    calls = {"n": 0}

    def full_disk(fd, bufs):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs)

    monkeypatch.setattr(shardfile.os, "writev", full_disk)
    with pytest.raises(OutOfSpaceError) as e:
        write_small(tmp_path, list(range(6, 20)))
    assert isinstance(e.value.__cause__, OutOfSpaceError)
    monkeypatch.setattr(shardfile.os, "writev", real)
    after = check_cache(tmp_path)
    assert before <= after and after < set(range(20))
    assert CliRunner().invoke(cli, ["cache", "verify", str(tmp_path)]).exit_code == 0


def test_fingerprint_mismatch_names_field(tmp_path):
    write_small(tmp_path, [0])
    with pytest.raises(CacheMismatchError, match=r"\btokenizer_hash\b"):
        CacheWriter(tmp_path, fp(tokenizer_hash="other"))
    with pytest.raises(CacheMismatchError, match=r"\btap_layer_ids\b"):
        CacheWriter(tmp_path, fp(tap_layer_ids=(1, 4)))


def test_info_json_values(tmp_path):
    ids = list(range(10))
    write_small(tmp_path, ids)
    result = CliRunner().invoke(cli, ["cache", "info", "--json", str(tmp_path)])
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    tokens = sum(len(sample(i)[0]) for i in ids)
    assert d["samples"] == 10 and d["tokens"] == tokens
    assert d["loss_tokens"] == sum(int(sample(i)[1].sum()) for i in ids)
    assert d["tap_layer_ids"] == list(TAPS) and d["storage"] == "bf16" and d["shards"] >= 2
    assert d["bytes_on_disk"] > tokens * len(TAPS) * D * 2
    # tiny shards: zarr.json metadata dominates; at real sizes it is ~K*D*2 (benchmarks/)
    assert d["bytes_per_token"] == pytest.approx(d["shard_bytes"] / tokens)
    assert d["bytes_per_token"] > len(TAPS) * D * 2
    text = CliRunner().invoke(cli, ["cache", "info", str(tmp_path)])
    assert text.exit_code == 0 and "loss tokens" in text.output
    assert CliRunner().invoke(cli, ["cache", "verify", "--help"]).exit_code == 0


def test_resume_after_abort_commits_nothing_partial(tmp_path):
    s = [sample(i) for i in range(3)]
    with pytest.raises(KeyboardInterrupt):
        with CacheWriter(tmp_path, fp(), shard_tokens=10_000) as w:
            w.append(sample_ids=np.arange(3), lengths=np.array([len(x[0]) for x in s]),
                     input_ids=np.concatenate([x[0] for x in s]), loss_mask=np.concatenate([x[1] for x in s]),
                     hidden=torch.cat([x[2] for x in s]))
            raise KeyboardInterrupt
    assert committed_sample_ids(tmp_path) == set()
    write_small(tmp_path, [0, 1, 2])
    assert committed_sample_ids(tmp_path) == {0, 1, 2}


def test_one_writer_per_rank(tmp_path):
    from dflash.errors import LockedError

    w0 = CacheWriter(tmp_path, fp(), rank=0)
    with pytest.raises(LockedError, match=f"PID {os.getpid()}"):
        CacheWriter(tmp_path, fp(), rank=0)
    w1 = CacheWriter(tmp_path, fp(), rank=1)  # other ranks write beside it
    w1.close()
    w0.close()
    CacheWriter(tmp_path, fp(), rank=0).close()  # released on close
    w = CacheWriter(tmp_path, fp(), rank=0)
    w.abort()
    CacheWriter(tmp_path, fp(), rank=0).close()  # and on abort


def test_worker_dflash_error_keeps_its_type(tmp_path):
    # A malformed line in another rank's log stops this rank's writer at its first manifest update (in the
    # writer thread): the caller must get the CacheFormatError (one line in the CLI), not a RuntimeError.
    write_small(tmp_path, [0, 1])
    (tmp_path / "commits" / "rank-1.jsonl").write_text("not json\n")
    with pytest.raises(CacheFormatError, match="rank-1.jsonl line 1") as e:
        write_small(tmp_path, [2, 3])
    assert isinstance(e.value.__cause__, CacheFormatError)


def test_new_commit_log_is_made_durable(tmp_path, monkeypatch):
    # Creating commits/rank-R.jsonl adds a directory entry: without an fsync of commits/ a power loss can
    # drop the whole log while its shard stays renamed into shards/.
    from dflash.cache import commit as cm

    synced = []
    real = cm.fsync_dir
    monkeypatch.setattr(cm, "fsync_dir", lambda p: (synced.append(os.fspath(p)), real(p)))
    write_small(tmp_path, [0, 1, 2])
    commits = os.path.join(tmp_path, "commits")
    assert commits in synced
    n = synced.count(commits)
    write_small(tmp_path, [3, 4])  # appending to an existing log adds no entry: no extra directory fsync
    assert synced.count(commits) == n


def test_info_shows_target_greedy_and_readable_bytes(tmp_path):
    s = [sample(i) for i in range(4)]
    with CacheWriter(tmp_path, fp(target="/models/qwen", target_greedy=True), shard_tokens=40) as w:
        w.append(sample_ids=np.arange(4), lengths=np.array([len(x[0]) for x in s]),
                 input_ids=np.concatenate([x[0] for x in s]), loss_mask=np.concatenate([x[1] for x in s]),
                 hidden=torch.cat([x[2] for x in s]))
    d = json.loads(CliRunner().invoke(cli, ["cache", "info", "--json", str(tmp_path)]).output)
    assert d["target_greedy"] is True and d["target"] == "/models/qwen" and d["max_length"] == 0
    text = CliRunner().invoke(cli, ["cache", "info", str(tmp_path)]).output
    rows = dict(line.split(None, 1) if not line.startswith(("bytes", "loss", "hidden")) else
                (line[:16].strip(), line[16:]) for line in text.strip().splitlines())
    assert rows["target"].strip() == "/models/qwen" and rows["target_greedy"].strip() == "yes"
    assert rows["bytes on disk"].strip().endswith("KB") and "," not in rows["bytes on disk"]


def test_info_says_when_an_extraction_holds_the_cache(tmp_path):
    from dflash.locks import FolderLock

    write_small(tmp_path, [0, 1])
    with FolderLock(tmp_path, purpose="dflash extract --output x"):
        d = json.loads(CliRunner().invoke(cli, ["cache", "info", "--json", str(tmp_path)]).output)
        assert f"PID {os.getpid()}" in d["being_written_by"] and "dflash extract" in d["being_written_by"]
        text = CliRunner().invoke(cli, ["cache", "info", str(tmp_path)]).output
        assert "being written" in text
    d = json.loads(CliRunner().invoke(cli, ["cache", "info", "--json", str(tmp_path)]).output)
    assert d["being_written_by"] is None


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_verify_finds_nan_and_inf_features(tmp_path, storage, monkeypatch):
    """Sound bytes of unsound values: checksums pass, verify still names the chunks whose features are nan/inf.
    Such a cache comes from a writer without the write-time check (format.check_stored_finite), made so here."""
    from dflash.cache import writer

    monkeypatch.setattr(writer, "check_stored_finite", lambda *_: None)
    ids = list(range(8))
    s = [sample(i) for i in ids]
    s[3][2][0, 1, 5] = float("inf")
    s[6][2][-1, 0, 0] = float("nan")
    with CacheWriter(tmp_path, fp(storage=storage), shard_tokens=40) as w:
        w.append(sample_ids=np.array(ids), lengths=np.array([len(x[0]) for x in s]),
                 input_ids=np.concatenate([x[0] for x in s]), loss_mask=np.concatenate([x[1] for x in s]),
                 hidden=torch.cat([x[2] for x in s]))
    result = CliRunner().invoke(cli, ["cache", "verify", str(tmp_path)])
    assert result.exit_code == 1, result.output
    bad = [line for line in result.output.splitlines() if line.startswith("BAD:")]
    assert bad and all(line.endswith("nan/inf values (the features were stored so)") for line in bad), result.output
    assert sum(" array hidden chunk " in line for line in bad) == 2   # the chunks of sample 3's and sample 6's taps
    # fp8 stores a row's inf as its scale (amax inf), which turns the row's codes into NaN
    assert any(" array scales chunk " in line for line in bad) == (storage == "fp8")


def test_non_finite_values_per_storage_and_array():
    from dflash.cache import quant4
    from dflash.cache.format import non_finite_values

    bf16 = torch.tensor([1.0, float("inf"), float("nan"), -float("inf"), 3e38], dtype=torch.bfloat16)
    assert non_finite_values("bf16", "hidden", bf16.view(torch.uint16).numpy()) == 3
    e4m3 = torch.tensor([448.0, -448.0, 0.0, float("nan")]).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert non_finite_values("fp8", "hidden", e4m3) == 1
    assert non_finite_values("fp8", "scales", np.array([1.0, np.inf, np.nan], np.float32)) == 2
    assert non_finite_values("bf16", "input_ids", np.array([0x7F80, 0xFFFF], np.uint16)) == 0   # ids, not features
    e8m0 = np.array([127, quant4.E8M0_NAN, 0], np.uint8)
    assert non_finite_values("e2m1-g32-e8m0", "group_scales", e8m0) == 1
    assert non_finite_values("e2m1-g32-e8m0", "hidden", np.full(4, 0xFF, np.uint8)) == 0   # codes: all finite
    assert non_finite_values("int4-g64-bf16", "group_scales", bf16.view(torch.uint16).numpy()) == 3
