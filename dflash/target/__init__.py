"""The target LLM: load it (text-only, bf16, SDPA), pick kernels per device, run it only up to the
deepest tap, and read just its embedding and LM head. docs/ARCHITECTURE.md says where a new target family goes."""

from dflash.target.forward import TappedForward
from dflash.target.head import HeadInfo, embedding_and_head
from dflash.target.load import load_target
from dflash.target.taps import default_tap_layer_ids, validate_tap_layer_ids

__all__ = [
    "HeadInfo",
    "TappedForward",
    "default_tap_layer_ids",
    "embedding_and_head",
    "load_target",
    "validate_tap_layer_ids",
]
