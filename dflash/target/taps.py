"""Which decoder layers of the target the drafter reads ("taps").

A tap id k means the residual stream after decoder layer k, i.e. HF `output_hidden_states[k + 1]`
(index 0 is the embedding output). The default follows z-lab `build_target_layer_ids`: 5 layers evenly
spread between the second layer and the third-to-last one (DFlash paper section 5), so published drafters
and ours agree on the taps for the same target (64 layers -> 1, 16, 31, 46, 61).
"""

from __future__ import annotations

from collections.abc import Sequence

from dflash.errors import ConfigError


def default_tap_layer_ids(num_layers: int, num_taps: int = 5) -> tuple[int, ...]:
    """z-lab `build_target_layer_ids(num_layers, num_taps)`, as a tuple.

    n == 1 gives the middle layer; otherwise ids are `round(1 + i * (L - 4) / (n - 1))` with Python's
    round (half to even), exactly as z-lab computes them, so 30 layers give (1, 8, 14, 20, 27).
    """
    if num_layers < 1:
        raise ConfigError(f"num_layers must be >= 1, got {num_layers}")
    if num_taps < 1:
        raise ConfigError(f"num_taps must be >= 1, got {num_taps}")
    if num_taps == 1:
        return (num_layers // 2,)
    start, end = 1, num_layers - 3
    if end <= start:
        raise ConfigError(
            f"a target with {num_layers} layers is too shallow for {num_taps} default taps "
            "(need at least 5 layers); pass tap_layer_ids explicitly"
        )
    ids = tuple(int(round(start + i * (end - start) / (num_taps - 1))) for i in range(num_taps))
    if len(set(ids)) != len(ids):
        raise ConfigError(
            f"{num_taps} default taps over {num_layers} layers collide ({ids}); use fewer taps "
            "or pass tap_layer_ids explicitly"
        )
    return ids


def validate_tap_layer_ids(tap_layer_ids: Sequence[int], *, num_layers: int) -> tuple[int, ...]:
    """Check user taps: non-empty, integers, in [0, num_layers), unique and ascending. Returns a tuple.

    Ascending order is required (not silently sorted) because the order fixes the layout of the drafter's
    fc input and of the cache's tap axis; a reordered list would silently permute features.
    """
    ids = tuple(tap_layer_ids)
    if not ids:
        raise ConfigError("tap_layer_ids is empty; give at least one decoder-layer id")
    for k in ids:
        if isinstance(k, bool) or not isinstance(k, int):
            raise ConfigError(f"tap_layer_ids must be integers, got {k!r} in {list(ids)}")
        if not 0 <= k < num_layers:
            raise ConfigError(
                f"tap layer id {k} is out of range for a target with {num_layers} decoder layers "
                f"(valid: 0..{num_layers - 1})"
            )
    if len(set(ids)) != len(ids):
        raise ConfigError(f"tap_layer_ids has duplicates: {list(ids)}")
    if list(ids) != sorted(ids):
        raise ConfigError(f"tap_layer_ids must be ascending, got {list(ids)}; use {sorted(ids)}")
    return ids
