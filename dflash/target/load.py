"""Load the target LLM as a text-only causal LM, frozen, in bf16, with SDPA attention.

A local HF folder or a hub name (when the hub is reachable). Vision-language checkpoints such as
Qwen3.5 (`Qwen3_5ForConditionalGeneration`, config with `text_config`) load text-only: transformers maps
their config to the text causal LM (`Qwen3_5ForCausalLM`) and their `model.language_model.*` weights onto
it, dropping the vision tower and MTP weights we never run. A missing path fails before any work.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

from dflash.errors import ModelNotFoundError
from dflash.target.kernels import KernelChoice, select_kernels
from dflash.target.registry import text_config  # noqa: F401  (one definition; callers import it from here)

log = logging.getLogger(__name__)

_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_name(path: str | os.PathLike) -> bool:
    """True for "org/name" strings that are not an existing local path."""
    s = os.fspath(path)
    return not os.path.exists(s) and _HUB_NAME.fullmatch(s) is not None


def check_model_path(path: str | os.PathLike) -> str:
    """Return `path` as a string if it is a local model folder (has config.json) or a hub name.

    Raises ModelNotFoundError for anything else, so a typo fails in milliseconds, not after a load.
    """
    s = os.fspath(path)
    if os.path.isdir(s):
        if not os.path.isfile(os.path.join(s, "config.json")):
            raise ModelNotFoundError(f"{s} is a folder but has no config.json: not a Hugging Face model folder")
        return s
    if is_hub_name(s):
        return s
    raise ModelNotFoundError(f"target model not found: {s} (give a local HF model folder or a hub name org/name)")


def load_target(
    path: str | os.PathLike,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    fla_conv: bool = False,
) -> tuple[torch.nn.Module, object]:
    """Load the target as a frozen, eval-mode causal LM on `device`, plus its tokenizer.

    `fla_conv` swaps transformers' torch causal-conv1d fallback for FLA's Triton kernel on CUDA
    (see dflash.target.kernels). The kernel choice is stored on the model as `dflash_kernels`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = check_model_path(path)
    device = torch.device(device)
    try:
        config = AutoConfig.from_pretrained(src)
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"cannot read the config of target {src}: {e}") from e
    if getattr(config, "text_config", None) is not None:
        log.info("target %s is %s (multimodal): loading its text model and LM head only",
                 src, (config.architectures or [type(config).__name__])[0])
    kwargs: dict = {"dtype": dtype, "attn_implementation": "sdpa"}
    if device.type == "cuda":
        kwargs["device_map"] = {"": device}  # load straight onto the GPU, no full CPU copy
    try:
        model = AutoModelForCausalLM.from_pretrained(src, **kwargs)
    except ValueError as e:  # unrecognized configuration class: no causal-LM mapping for this model type
        raise ModelNotFoundError(f"target {src} cannot be loaded as a text causal LM: {e}") from e
    model = model.to(device).eval().requires_grad_(False)
    choice: KernelChoice = select_kernels(model, device, fla_conv=fla_conv)
    model.dflash_kernels = choice
    tokenizer = AutoTokenizer.from_pretrained(src)
    cfg = text_config(model.config)
    log.info("loaded target %s: %s, %d layers, hidden %d, %s on %s", src, type(model).__name__,
             cfg.num_hidden_layers, cfg.hidden_size, dtype, device)
    return model, tokenizer


def local_model_dir(path: str | os.PathLike) -> Path:
    """A local folder for `path`: itself, or the hub snapshot of its config/index/safetensors metadata."""
    s = check_model_path(path)
    if os.path.isdir(s):
        return Path(s)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(s, allow_patterns=["*.json"]))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, auth: all mean "not found" to the user
        raise ModelNotFoundError(f"target {s} is not a local folder and the hub did not serve it: {e}") from e
