"""Which key a draft-block query may see, and the two attention kernels that apply it.

Shapes: C = packed context tokens, J = blocks, B = block size, Q = J*B block (query) tokens,
K = C + Q keys ([context; blocks]), h = heads, d = head_dim.

One packed batch holds several sequences concatenated. A block query sees (a) context tokens of its own
sequence whose position is strictly below the block's anchor (the feature at the anchor itself is not
available at inference, method doc 2) and (b) all B slots of its own block; nothing else.
`block_attention_mask` is that predicate, written once with broadcasting tensor ops so it serves both the
dense path (evaluated on [q, k] index grids) and flex attention's mask_mod (evaluated on scalar indices).

Tradeoff: the dense path (SDPA + boolean mask, CPU, and any device without flex) processes queries in
chunks of whole blocks and keeps only the context keys plus the chunk's own block keys (other blocks are
never visible), so memory is O(chunk * (C + chunk)) instead of O(Q * (C + Q)); each chunk is
checkpointed so the attention probabilities are not kept for backward. Flex attention (CUDA) skips the
masked-out tiles entirely and is the fast path; torch 2.13 has no CPU backward for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash.errors import ConfigError

log = logging.getLogger(__name__)

CONTEXT_BLOCK = -1   # block id of context keys


def block_attention_mask(*, q_seq: torch.Tensor, q_anchor: torch.Tensor, q_block: torch.Tensor,
                         kv_seq: torch.Tensor, kv_pos: torch.Tensor, kv_block: torch.Tensor) -> torch.Tensor:
    """True where a block query may attend to a key. All arguments broadcast against each other.

    q_seq/q_anchor/q_block: the query's sequence id, its block's anchor position and its block id.
    kv_seq/kv_pos/kv_block: the key's sequence id, position, and block id (CONTEXT_BLOCK for context keys).
    """
    is_ctx = kv_block == CONTEXT_BLOCK
    sees_ctx = is_ctx & (kv_seq == q_seq) & (kv_pos < q_anchor)
    sees_own_block = (kv_block == q_block) & ~is_ctx
    return sees_ctx | sees_own_block


@dataclass(frozen=True)
class BlockLayout:
    """Where every context token and block of one packed batch sits. Integer tensors on one device."""

    ctx_seq_C: torch.Tensor     # sequence id of each context token
    ctx_pos_C: torch.Tensor     # position of each context token inside its sequence
    block_seq_J: torch.Tensor   # sequence id of each block
    anchor_J: torch.Tensor      # anchor position of each block (slot k sits at anchor + k)
    block_size: int

    @property
    def num_ctx(self) -> int:
        return self.ctx_seq_C.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.anchor_J.shape[0]

    @property
    def q_pos_Q(self) -> torch.Tensor:
        offs_B = torch.arange(self.block_size, device=self.anchor_J.device)
        return (self.anchor_J[:, None] + offs_B).reshape(-1)

    @property
    def kv_pos_K(self) -> torch.Tensor:
        return torch.cat([self.ctx_pos_C, self.q_pos_Q])

    def query_meta(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(seq, anchor, block) per query token, [Q] each."""
        B = self.block_size
        block_J = torch.arange(self.num_blocks, device=self.anchor_J.device)
        return (self.block_seq_J.repeat_interleave(B), self.anchor_J.repeat_interleave(B),
                block_J.repeat_interleave(B))

    def key_meta(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(seq, pos, block) per key token, [K] each; context keys first."""
        q_seq, _, q_block = self.query_meta()
        ctx_block = torch.full_like(self.ctx_seq_C, CONTEXT_BLOCK)
        return (torch.cat([self.ctx_seq_C, q_seq]), self.kv_pos_K, torch.cat([ctx_block, q_block]))

    def to(self, device: torch.device | str) -> "BlockLayout":
        return BlockLayout(ctx_seq_C=self.ctx_seq_C.to(device), ctx_pos_C=self.ctx_pos_C.to(device),
                           block_seq_J=self.block_seq_J.to(device), anchor_J=self.anchor_J.to(device),
                           block_size=self.block_size)


def dense_mask(layout: BlockLayout) -> torch.Tensor:
    """The full [Q, K] boolean mask (tests and small batches; the kernels never build it whole)."""
    q_seq, q_anchor, q_block = layout.query_meta()
    kv_seq, kv_pos, kv_block = layout.key_meta()
    return block_attention_mask(q_seq=q_seq[:, None], q_anchor=q_anchor[:, None], q_block=q_block[:, None],
                                kv_seq=kv_seq[None], kv_pos=kv_pos[None], kv_block=kv_block[None])


# ---------------------------------------------------------------------------------------------- dense path

def _sdpa_chunk(q_hqd, k_hkd, v_hkd, q_seq, q_anchor, q_block, kv_seq, kv_pos, kv_block):
    mask_qk = block_attention_mask(q_seq=q_seq[:, None], q_anchor=q_anchor[:, None], q_block=q_block[:, None],
                                   kv_seq=kv_seq[None], kv_pos=kv_pos[None], kv_block=kv_block[None])
    return F.scaled_dot_product_attention(q_hqd[None], k_hkd[None], v_hkd[None], attn_mask=mask_qk,
                                          enable_gqa=True)[0]


def dense_block_attention(q_hQd: torch.Tensor, k_hKd: torch.Tensor, v_hKd: torch.Tensor,
                          layout: BlockLayout, *, chunk_tokens: int = 2048) -> torch.Tensor:
    """SDPA with the block mask, in query chunks of whole blocks. Returns [h, Q, d]."""
    C, B = layout.num_ctx, layout.block_size
    q_seq, q_anchor, q_block = layout.query_meta()
    kv_seq, kv_pos, kv_block = layout.key_meta()
    blocks_per_chunk = max(1, chunk_tokens // B)
    use_ckpt = torch.is_grad_enabled() and (q_hQd.requires_grad or k_hKd.requires_grad)
    outs = []
    for j0 in range(0, layout.num_blocks, blocks_per_chunk):
        j1 = min(j0 + blocks_per_chunk, layout.num_blocks)
        qs = slice(j0 * B, j1 * B)
        # Keys: every context token plus this chunk's block tokens; other blocks' keys are never visible.
        ks = torch.cat([torch.arange(C, device=k_hKd.device),
                        torch.arange(C + j0 * B, C + j1 * B, device=k_hKd.device)])
        args = (q_hQd[:, qs], k_hKd[:, ks], v_hKd[:, ks], q_seq[qs], q_anchor[qs], q_block[qs],
                kv_seq[ks], kv_pos[ks], kv_block[ks])
        outs.append(checkpoint(_sdpa_chunk, *args, use_reentrant=False) if use_ckpt else _sdpa_chunk(*args))
    return torch.cat(outs, dim=1)


# ----------------------------------------------------------------------------------------------- flex path

_compiled: dict[str, object] = {}


def _compiled_fn(name: str):
    """torch.compile'd flex_attention / create_block_mask, built once per process. Shapes change every
    packed batch; torch.compile's automatic dynamic shapes recompile once and then stay dynamic."""
    if name not in _compiled:
        import torch.nn.attention.flex_attention as fa
        # Uncompiled flex attention materialises the full score matrix; compiled it is a fused kernel that
        # skips fully masked tiles. Compiled create_block_mask never builds the dense [Q, K] mask.
        _compiled[name] = torch.compile(getattr(fa, name))
    return _compiled[name]


def flex_block_mask(layout: BlockLayout, *, compiled: bool | None = None):
    """A flex-attention BlockMask for `layout`, using the same predicate as the dense path.
    compiled defaults to True on CUDA (eager create_block_mask builds the dense mask first)."""
    from torch.nn.attention.flex_attention import create_block_mask

    q_seq, q_anchor, q_block = layout.query_meta()
    kv_seq, kv_pos, kv_block = layout.key_meta()
    Q, K = q_seq.shape[0], kv_seq.shape[0]

    def mask_mod(b, h, q_idx, kv_idx):
        # Tiles straddling the end may be evaluated past Q/K and then discarded: keep the lookups in bounds.
        qi, ki = q_idx.clamp(max=Q - 1), kv_idx.clamp(max=K - 1)
        return block_attention_mask(q_seq=q_seq[qi], q_anchor=q_anchor[qi], q_block=q_block[qi],
                                    kv_seq=kv_seq[ki], kv_pos=kv_pos[ki], kv_block=kv_block[ki])

    device = layout.anchor_J.device
    if compiled is None:
        compiled = device.type == "cuda"
    fn = _compiled_fn("create_block_mask") if compiled else create_block_mask
    return fn(mask_mod, B=None, H=None, Q_LEN=Q, KV_LEN=K, device=device)


def flex_block_attention(q_hQd: torch.Tensor, k_hKd: torch.Tensor, v_hKd: torch.Tensor,
                         block_mask, *, compiled: bool = True) -> torch.Tensor:
    """Flex attention with a prebuilt BlockMask (build it once per forward, share across layers)."""
    if compiled:
        fn = _compiled_fn("flex_attention")
    else:
        from torch.nn.attention.flex_attention import flex_attention as fn
    return fn(q_hQd[None], k_hKd[None], v_hKd[None], block_mask=block_mask, enable_gqa=True)[0]


_logged: set[str] = set()


def choose_backend(device: torch.device, requested: str = "auto") -> str:
    """'flex' on CUDA, 'dense' elsewhere, unless `requested` names one; logs the choice once with its reason."""
    if requested not in ("auto", "dense", "flex"):
        raise ConfigError(f"attention backend {requested!r}: use 'auto', 'dense' or 'flex'")
    if requested != "auto":
        backend, reason = requested, "requested explicitly"
    elif device.type == "cuda":
        backend, reason = "flex", "CUDA device: compiled flex attention skips masked tiles"
    else:
        backend, reason = "dense", (f"{device.type} device: flex attention has no {device.type} backward "
                                    "(torch 2.13), using chunked SDPA with a boolean mask")
    key = f"{device.type}:{backend}"
    if key not in _logged:
        _logged.add(key)
        log.info("drafter attention backend %s (%s)", backend, reason)
    return backend
