"""Sampled regeneration that does not depend on batching: Gumbel-max with counter-based noise.

Shapes: B = rows (slots or prefill rows), V = vocabulary.

Why: a drafter trained on the target's greedy responses to the ~17K ShareGPT conversations memorises them over
the paper's 6 epochs (the reference run's trainer accepted 7.9 tokens on its own batches against a held-out tau
of 2.6); sampled responses to the same prompts are more of the target's own text. Training data may be sampled;
eval caches stay greedy (their records are marked greedy, sampled ones never are).

Why not torch.multinomial: its draws depend on which rows share a call and on the generator's state, so a
resumed job or another slot count would sample other tokens. Here the noise of vocabulary entry v for the token
after position p of request k is a pure function of (seed, k, p, v): the token is
    argmax_v(logits[v] / temperature + G(seed, k, p, v)),   G = -log(-log(U)),  U uniform in (0, 1)
which is a draw from softmax(logits / temperature) (the Gumbel-max trick), the same whatever the batch, slot or
run. U comes from a 32-bit integer hash (mix32) computed in int64 torch ops (every product stays below 2^63),
so it runs inside a captured CUDA graph. Tradeoff: a few [B, V] int64 temporaries per step (512 slots x 49,152
ids: ~200 MB each on the GPU).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["gumbel_noise", "mix32", "pick_tokens", "request_key"]

_M32 = 0xFFFFFFFF
# odd multipliers below 2^31: x < 2^32 times one stays below 2^63 in int64
_POS_MUL, _VOCAB_MUL = 0x61C88647, 0x2545F491
_MIX = ((16, 0x7FEB352D), (15, 0x2C1B3C6D), (12, 0x297A2D39))


def request_key(seed: int, key: str) -> int:
    """The 32-bit stream id of request `key` under `seed` (the same in every process: no Python hash())."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=4).digest(), "little")


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2^32): xor-shift / multiply rounds, each taken mod 2^32."""
    for shift, mul in _MIX:
        x = x ^ (x >> shift)
        x = (x * mul) & _M32
    return x ^ (x >> 15)


def gumbel_noise(key_B: torch.Tensor, pos_B: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [B, V]: Gumbel noise of vocabulary entry v for the token after position pos_B[b] of the request
    whose request_key is key_B[b] (int64 tensors)."""
    import torch

    v_V = torch.arange(vocab, device=key_B.device, dtype=torch.int64)
    x = (key_B[:, None] + pos_B[:, None] * _POS_MUL + v_V[None, :] * _VOCAB_MUL) & _M32
    u = ((mix32(x) >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))   # 24 bits: exact in float32, in (0, 1)
    return -torch.log(-torch.log(u))


def pick_tokens(logits_BV: torch.Tensor, *, temperature: float, key_B: torch.Tensor | None = None,
                pos_B: torch.Tensor | None = None) -> torch.Tensor:
    """The next token per row: argmax (temperature 0: greedy), else a draw from softmax(logits / temperature)
    fixed by (key_B, pos_B) (module docstring)."""
    if temperature <= 0:
        return logits_BV.argmax(-1)
    g = gumbel_noise(key_B, pos_B, logits_BV.shape[-1])
    return (logits_BV.float() / temperature + g).argmax(-1)
