"""A vLLM OpenAI server for `dflash serve-check`: launched locally from a vLLM install (its python), or reached
at a URL; and the few HTTP calls the check makes (models, version, greedy completions on token ids, /metrics).

The local launch runs the model card's command (dflash.drafter.serving.vllm_server_argv) with the python given,
plus the flags only a local check needs: --host/--port, --dtype (float32 for an exact check) and
--max-model-len. On CPU (vLLM's CPU build) it also needs, found by trying on a 2-core machine:
LD_PRELOAD of the venv's libiomp5.so (vLLM's CPU kernels are built against Intel's OpenMP), a KV-cache size
(VLLM_CPU_KVCACHE_SPACE, GiB; the default 4 is more than a small test machine spares) and --enforce-eager
(no graph compile: the server starts in ~1 min instead of ~2.5). Caches go under the run folder
(VLLM_CACHE_ROOT) so a check leaves nothing behind.
Tradeoff: stdlib urllib only (no client library in the project's env); requests are sent one at a time, so
the served batch is always one sequence, as in `dflash eval`'s chains.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from dflash.drafter.serving import vllm_server_argv
from dflash.errors import DflashError

START_TIMEOUT_S = 900.0
"""How long a local server may take to answer /health (measured ~1 min on 2 cores with --enforce-eager)."""
REQUEST_TIMEOUT_S = 600.0


class ServeError(DflashError):
    """The vLLM server could not be started or reached, or answered something unusable."""


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How `dflash serve-check` starts a local vLLM server."""

    python: str
    """The python of a vLLM install (e.g. the venv dflash.serve.vllm_env builds)."""
    dtype: str = "float32"
    """--dtype of the target and drafter; float32 gives the exact check."""
    max_model_len: int = 2048
    """--max-model-len: the longest prompt + response the server accepts."""
    cpu: bool = True
    """Add the CPU build's settings (libiomp5 preload, KV-cache space, --enforce-eager)."""
    kvcache_gib: int = 2
    """VLLM_CPU_KVCACHE_SPACE on CPU."""
    extra_args: tuple[str, ...] = ()
    """More vLLM flags, appended last."""


def launch_argv(cfg: LaunchConfig, *, target: str, drafter: str, block_size: int, port: int) -> list[str]:
    """The model card's vLLM command with this python, plus the local check's flags."""
    argv = vllm_server_argv(target=target, drafter=drafter, block_size=block_size, python=cfg.python)
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", cfg.dtype,
             "--max-model-len", str(cfg.max_model_len)]
    if cfg.cpu:
        argv.append("--enforce-eager")
    return argv + list(cfg.extra_args)


def launch_env(cfg: LaunchConfig, *, cache_root: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["VLLM_CACHE_ROOT"] = str(cache_root)
    if cfg.cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kvcache_gib))
        # VENV/lib/libiomp5.so (intel-openmp's wheel puts it there); beside the link, not the resolved python:
        # a venv's bin/python links to the base interpreter
        iomp = Path(cfg.python).parent.parent / "lib" / "libiomp5.so"
        if iomp.exists():
            env["LD_PRELOAD"] = " ".join(x for x in (str(iomp), env.get("LD_PRELOAD", "")) if x)
    return env


class LocalVllm:
    """A vLLM server process on 127.0.0.1 (context manager: stopped on exit). Its output goes to `log_path`."""

    def __init__(self, cfg: LaunchConfig, *, target: str, drafter: str, block_size: int, workdir: Path,
                 port: int) -> None:
        self.argv = launch_argv(cfg, target=target, drafter=drafter, block_size=block_size, port=port)
        self.env = launch_env(cfg, cache_root=Path(workdir) / "vllm-cache")
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(workdir) / "vllm-server.log"
        self.proc: subprocess.Popen | None = None
        self.start_seconds = float("nan")

    def start(self, *, timeout_s: float = START_TIMEOUT_S) -> LocalVllm:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(self.argv) + "\n")
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                raise ServeError(f"vLLM exited with code {self.proc.returncode} while starting; its log "
                                 f"{self.log_path} ends: {log_tail(self.log_path)}")
            if healthy(self.url):
                break
            if time.monotonic() - t0 > timeout_s:
                self.stop()
                raise ServeError(f"vLLM did not answer {self.url}/health within {timeout_s:.0f} s; see {self.log_path}")
            time.sleep(1.0)
        self.start_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """SIGTERM to the server's process group (its engine core is a child), SIGKILL after 30 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass

    def __enter__(self) -> LocalVllm:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return " | ".join(Path(path).read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _get(url: str, *, timeout: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def healthy(url: str) -> bool:
    try:
        _get(url.rstrip("/") + "/health", timeout=5)
        return True
    except (urllib.error.URLError, OSError):
        return False


def served_model(url: str) -> str:
    """The model name the server answers to (its first /v1/models entry)."""
    try:
        data = json.loads(_get(url.rstrip("/") + "/v1/models", timeout=30))
        return str(data["data"][0]["id"])
    except (urllib.error.URLError, OSError) as e:
        raise ServeError(f"cannot reach a vLLM server at {url} ({e}): start one, or pass --vllm-python") from e
    except (KeyError, IndexError, ValueError) as e:
        raise ServeError(f"{url}/v1/models answered no model list ({e}): is it a vLLM server?") from e


def engine_version(url: str) -> str | None:
    """vLLM's version as its /version answers it; None when it does not (another server, or an old vLLM)."""
    try:
        return str(json.loads(_get(url.rstrip("/") + "/version", timeout=30))["version"])
    except (urllib.error.URLError, OSError, KeyError, TypeError, ValueError):
        return None


def metrics_text(url: str) -> str:
    try:
        return _get(url.rstrip("/") + "/metrics", timeout=30).decode()
    except (urllib.error.URLError, OSError) as e:
        raise ServeError(f"cannot read {url}/metrics ({e})") from e


def greedy_completion(url: str, *, model: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The served greedy continuation of prompt_ids (token ids, stop token included as vLLM returns it)."""
    body = {"model": model, "prompt": list(map(int, prompt_ids)), "max_tokens": int(max_tokens), "temperature": 0.0,
            "return_token_ids": True}
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            data = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise ServeError(f"{url}/v1/completions answered {e.code}: {e.read()[:500]!r}") from e
    except (urllib.error.URLError, OSError) as e:
        raise ServeError(f"cannot reach {url}/v1/completions ({e})") from e
    ids = data["choices"][0].get("token_ids")
    if ids is None:
        raise ServeError(f"{url} returned no token_ids (return_token_ids needs vLLM >= 0.10)")
    return [int(t) for t in ids]
