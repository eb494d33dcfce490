"""`dflash generate --endpoint` against a real OpenAI-compatible server: `transformers serve` serving the SmolLM2
folder on CPU on a free localhost port, started here and stopped afterwards. Whole conversations, records
marked with the endpoint and never target-greedy; a server that stops answering mid-run (SIGSTOP) ends the
run with one clear line, and the rerun resumes from the committed chunks; an unreachable endpoint fails fast."""

import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from click.testing import CliRunner

from cli.main import cli

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUESTIONS = ["Say hi.", "Name a color.", "What is 2+2?", "Name a fruit.", "Say yes.", "Name a city."]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    exe = shutil.which("transformers", path=os.path.dirname(sys.executable)) or shutil.which("transformers")
    assert exe, "transformers CLI not found (pip install -e '.[test]' installs the serving extra)"
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([exe, "serve", str(smollm2_dir), "--host", "127.0.0.1", "--port", str(port),
                                 "--device", "cpu", "--dtype", "float32"],
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "transformers serve did not come up"
            time.sleep(0.3)
        yield proc, f"http://127.0.0.1:{port}/v1", str(smollm2_dir)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _data(path, n):
    with open(path, "w") as f:
        for i, q in enumerate(QUESTIONS[:n]):
            turns = [{"from": "human", "value": q}, {"from": "gpt", "value": "old"}]
            if i % 2 == 0:
                turns += [{"from": "human", "value": "And again?"}, {"from": "gpt", "value": "old"}]
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")


def _args(url, served, data, out, *extra):
    return ["generate", "--endpoint", url, "--served-model", served, "--data", str(data), "--output", str(out),
            "--max-new-tokens", "4", "--chunk-conversations", "2", "--concurrency", "2", *extra]


def test_endpoint_regenerates_whole_conversations(server, tmp_path):
    from dflash.extract.preflight import config_hash, target_greedy_of

    _, url, served = server
    data, out = tmp_path / "d.jsonl", tmp_path / "ep.jsonl.gz"
    _data(data, 3)
    res = CliRunner().invoke(cli, _args(url, served, data, out), prog_name="dflash")
    assert res.exit_code == 0, res.output
    recs = [json.loads(x) for x in gzip.open(out, "rt")]
    assert [r["id"] for r in recs] == ["c0", "c1", "c2"]
    for i, r in enumerate(recs):
        roles = [m["role"] for m in r["messages"]]
        assert roles == (["user", "assistant"] * (2 if i % 2 == 0 else 1))
        assert r["messages"][0]["content"] == QUESTIONS[i]
        assert all(m["content"] and m["content"] != "old" for m in r["messages"] if m["role"] == "assistant")
        meta = r["dflash_generate"]
        assert meta["endpoint"] == url + "/chat/completions" and meta["served_model"] == served
        assert meta["greedy"] is False and "input_ids" not in r
        assert [t["stop_reason"] for t in meta["turns"]] and len(meta["turns"]) == roles.count("assistant")
    # training data, never an eval cache: extraction does not mark it target-greedy
    ok, why = target_greedy_of([str(out)], target_config_hashes={config_hash(served)})
    assert ok is False and "greedy marker" in why


def test_server_stopped_mid_run_then_resume(server, tmp_path):
    proc, url, served = server
    data, out = tmp_path / "d.jsonl", tmp_path / "cut.jsonl.gz"
    _data(data, 6)
    log = tmp_path / "cut.jsonl.gz.parts" / "commits.jsonl"
    args = _args(url, served, data, out, "--request-timeout", "10", "--retries", "1", "--max-consecutive-errors", "2")
    gen = subprocess.Popen([sys.executable, "-m", "cli.main", *args], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    try:
        deadline = time.monotonic() + 240
        while not (log.exists() and log.read_text().count("\n") >= 1):
            assert gen.poll() is None, gen.stderr.read()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGSTOP)  # the server stops answering (accepts, never replies)
        _, err = gen.communicate(timeout=120)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert gen.returncode == 1
    msg = [line for line in err.splitlines() if "2 attempts failed in a row" in line]
    assert len(msg) == 1 and url in msg[0] and "rerun" in msg[0], err[-2000:]
    committed = log.read_text().count("\n")
    assert 1 <= committed < 3 and not out.exists()

    # the same job (timeouts and retries are not part of it): the server first finishes the requests it held
    res = CliRunner().invoke(cli, args[:-6] + ["--request-timeout", "120"], prog_name="dflash")
    assert res.exit_code == 0, res.output
    assert f"resuming: {committed} chunks" in res.output
    recs = [json.loads(x) for x in gzip.open(out, "rt")]
    assert [r["id"] for r in recs] == [f"c{i}" for i in range(6)]  # none lost, none twice, input order


def test_unreachable_endpoint_fails_with_one_line(tmp_path):
    data, out = tmp_path / "d.jsonl", tmp_path / "x.jsonl.gz"
    _data(data, 2)
    url = f"http://127.0.0.1:{_free_port()}/v1"  # nothing listens there
    res = CliRunner().invoke(cli, _args(url, "m", data, out, "--retries", "1", "--max-consecutive-errors", "2"),
                             prog_name="dflash")
    assert res.exit_code == 1
    assert "2 attempts failed in a row" in res.output and "Connection refused" in res.output
    assert not out.exists()
