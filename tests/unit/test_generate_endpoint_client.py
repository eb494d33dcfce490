"""The endpoint client's retry rules against a local HTTP server (stdlib, in a thread) that answers in the
OpenAI chat-completion shape: 5xx is retried, a refused prompt (400) is skipped and counted, a run stops after
N failed attempts in a row. The real server (`transformers serve`) is in tests/e2e/test_generate_endpoint.py."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash.errors import DflashError
from dflash.generate.conversations import conversation_of
from dflash.generate.endpoint import EndpointClient, EndpointConfig, Failed, endpoint_chunk


class _Handler(BaseHTTPRequestHandler):
    script: list = []  # status codes to answer before succeeding, shared by the test

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        last = body["messages"][-1]["content"]
        status = self.script.pop(0) if self.script else (400 if "LONG" in last else 200)
        payload = ({"choices": [{"message": {"role": "assistant", "content": f"re: {last}"},
                                 "finish_reason": "length"}]} if status == 200 else {"detail": "no"})
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _cfg(url, **kw):
    return EndpointConfig(url=url, served_model="m", output="x.jsonl", data=("d",), backoff_s=0.01, **kw)


def test_retry_then_success_and_refused_prompt(server):
    _Handler.script[:] = [503, 500]
    client = EndpointClient(_cfg(server, retries=2))
    assert client.chat([{"role": "user", "content": "hi"}], max_tokens=4) == ("re: hi", "length", 2)  # words
    assert client.consecutive_errors == 0 and not client.stopped
    got = client.chat([{"role": "user", "content": "LONG"}], max_tokens=4)
    assert isinstance(got, Failed) and got.reason == "endpoint_rejected" and not client.stopped

    convs = [conversation_of([{"role": "user", "content": t}, {"role": "assistant", "content": "old"},
                              {"role": "user", "content": "more"}, {"role": "assistant", "content": "old"}],
                             index=i, location=f"d:{i}", record_id=str(i)) for i, t in enumerate(["a", "LONG"])]
    recs, stats = endpoint_chunk(convs, client=client, mode="all", max_new_tokens=4, meta={"greedy": False},
                                 on_batch=lambda n, t: None)
    assert [r["id"] for r in recs] == ["0"] and stats["skipped"] == {"endpoint_rejected": 1}
    assert [m["content"] for m in recs[0]["messages"]] == ["a", "re: a", "more", "re: more"]


def test_stop_after_consecutive_failed_attempts(server):
    _Handler.script[:] = [500] * 10
    client = EndpointClient(_cfg(server, retries=5, max_consecutive_errors=3, concurrency=1))
    with pytest.raises(DflashError, match="3 attempts failed in a row.*HTTP 500"):
        client.chat_many([[{"role": "user", "content": "hi"}]] * 2, max_tokens=4)
    assert len(_Handler.script) == 7  # stopped after the third attempt, not after all retries of both requests
    _Handler.script[:] = [404]
    client = EndpointClient(_cfg(server, retries=5))
    with pytest.raises(DflashError, match=r"a request failed 1 time\(s\).*HTTP 404"):  # 404: no retry
        client.chat_many([[{"role": "user", "content": "hi"}]], max_tokens=4)
