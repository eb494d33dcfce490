"""The dense (CPU) block-attention path on one packed training batch: each query chunk attending to the context
its own sequences see (attention.dense_block_attention, what the drafter uses) versus every chunk attending to
the whole packed context and to all the chunk's block keys (the path before 2026-12-01, kept here as the
baseline).

    python benchmarks/bench_dense_attention.py                       # CPU, train_tiny.yaml's attention shape
    python benchmarks/bench_dense_attention.py --batch-tokens 2048 4096

A batch packs sequences of --seq-len tokens up to --batch-tokens context tokens, every sequence with
min(--num-anchors, seq_len - 1) random anchors and blocks of --block-size (the paper's 512 x 16). Timed per
batch: one forward + backward of one attention layer (q/k/v [heads, tokens, head_dim], float32), median of
--repeats after a warm-up call, both methods on the same tensors; the outputs are checked equal. Times are
this process's CPU seconds on --threads 1 (a shared machine's other jobs do not inflate them; wall seconds
are recorded beside them).
Writes benchmarks/results/dense_attention_<name>.json with the command; the last stdout line is that JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import machine_info  # noqa: E402

from dflash.drafter.attention import BlockLayout, block_attention_mask, dense_block_attention  # noqa: E402
from dflash.train.objective import packed_layout  # noqa: E402


def _sdpa_chunk(q_hqd, k_hkd, v_hkd, q_seq, q_anchor, q_block, kv_seq, kv_pos, kv_block):
    mask_qk = block_attention_mask(q_seq=q_seq[:, None], q_anchor=q_anchor[:, None], q_block=q_block[:, None],
                                   kv_seq=kv_seq[None], kv_pos=kv_pos[None], kv_block=kv_block[None])
    return F.scaled_dot_product_attention(q_hqd[None], k_hkd[None], v_hkd[None], attn_mask=mask_qk,
                                          enable_gqa=True)[0]


def all_context_attention(q_hQd, k_hKd, v_hKd, layout: BlockLayout, *, chunk_tokens: int = 2048):
    """The baseline (the code before 2026-12-01): the same chunks, each an SDPA call over every context key of
    the batch plus the chunk's block keys."""
    C, B = layout.num_ctx, layout.block_size
    q_seq, q_anchor, q_block = layout.query_meta()
    kv_seq, kv_pos, kv_block = layout.key_meta()
    per_chunk = max(1, chunk_tokens // B)
    outs = []
    for j0 in range(0, layout.num_blocks, per_chunk):
        j1 = min(j0 + per_chunk, layout.num_blocks)
        qs = slice(j0 * B, j1 * B)
        ks = torch.cat([torch.arange(C), torch.arange(C + j0 * B, C + j1 * B)])
        args = (q_hQd[:, qs], k_hKd[:, ks], v_hKd[:, ks], q_seq[qs], q_anchor[qs], q_block[qs],
                kv_seq[ks], kv_pos[ks], kv_block[ks])
        outs.append(checkpoint(_sdpa_chunk, *args, use_reentrant=False))
    return torch.cat(outs, dim=1)


def batch(*, batch_tokens: int, seq_len: int, num_anchors: int, block_size: int, heads: int, kv_heads: int,
          head_dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [seq_len] * max(1, batch_tokens // seq_len)
    anchors = [torch.sort(torch.randperm(n - 1, generator=g)[:min(num_anchors, n - 1)])[0] for n in lengths]
    lay = packed_layout(lengths=lengths, anchors=anchors, block_size=block_size)
    Q, K = lay.num_blocks * block_size, lay.num_ctx + lay.num_blocks * block_size
    q = torch.randn(heads, Q, head_dim, generator=g, requires_grad=True)
    k = torch.randn(kv_heads, K, head_dim, generator=g, requires_grad=True)
    v = torch.randn(kv_heads, K, head_dim, generator=g, requires_grad=True)
    return lay, q, k, v


def timed(fn, repeats: int) -> tuple[float, float, torch.Tensor]:
    """Median CPU seconds of this process (robust to other jobs on a shared machine) and wall seconds."""
    out = fn()
    cpu, wall = [], []
    for _ in range(repeats):
        c, t = time.process_time(), time.perf_counter()
        out = fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - t)
    return statistics.median(cpu), statistics.median(wall), out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--seq-len", type=int, default=600)
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--chunk-tokens", type=int, default=2048, help="DFlashDrafter.dense_chunk_tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time equals work done)")
    ap.add_argument("--result-name", default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for bt in args.batch_tokens:
        lay, q, k, v = batch(batch_tokens=bt, seq_len=args.seq_len, num_anchors=args.num_anchors,
                             block_size=args.block_size, heads=args.heads, kv_heads=args.kv_heads,
                             head_dim=args.head_dim)

        def step(fn):
            def run():
                out = fn(q, k, v, lay, chunk_tokens=args.chunk_tokens)
                q.grad = k.grad = v.grad = None
                out.square().sum().backward()
                return out.detach()
            return run

        s_own, w_own, out_own = timed(step(dense_block_attention), args.repeats)
        s_all, w_all, out_all = timed(step(all_context_attention), args.repeats)
        max_diff = float((out_own - out_all).abs().max())
        assert max_diff < 1e-4, f"methods disagree by {max_diff}"
        row = {"batch_tokens": lay.num_ctx, "sequences": int(lay.ctx_seq_C[-1]) + 1,
               "Q": lay.num_blocks * args.block_size, "all_context_cpu_s": s_all, "own_sequences_cpu_s": s_own,
               "speedup": s_all / s_own, "all_context_wall_s": w_all, "own_sequences_wall_s": w_own,
               "max_abs_diff": max_diff}
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {"benchmark": "bench_dense_attention", "name": args.result_name,
              "command": "python benchmarks/bench_dense_attention.py " + " ".join(sys.argv[1:] if argv is None
                                                                                   else argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(torch.device("cpu")), "torch_threads": torch.get_num_threads(),
              "torch": torch.__version__, "settings": {k: v for k, v in vars(args).items() if k != "result_name"},
              "rows": rows}
    out = ROOT / "benchmarks" / "results" / f"dense_attention_{args.result_name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
