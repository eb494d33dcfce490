"""One Gated-DeltaNet layer's core on the Qwen3.5-27B shape (16 key heads, 48 value heads, head dim 128): FLA's
chunk_gated_delta_rule given q and k copied to the value heads' count by repeat_interleave (what transformers before
5.23 does in every GDN layer) against the key heads as they are (5.23 on: FLA's grouped value attention reads key
head j // 3 for value head j). dflash.target.kernels.GROUPED_KEY_HEADS_SINCE rests on this.

    python benchmarks/bench_gdn_heads.py                 # CUDA + flash-linear-attention; one JSON line
    python benchmarks/bench_gdn_heads.py --contiguous    # q, k, v as contiguous tensors of their own

By default q, k and v are the views transformers hands the kernel: slices of the conv output [B, T, 2*2048 + 6144].
Per form: the median of `--rounds` rounds of `--reps` synced calls each (after 3 untimed calls), the two forms
alternating; and whether their outputs are bit-identical.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from common import QWEN35_27B, machine_info, package_version  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16, help="sequences a forward (16 x 2,003 tokens: one 32K batch)")
    p.add_argument("--seq", type=int, default=2003, help="tokens a sequence")
    p.add_argument("--contiguous", action="store_true", help="q, k, v as contiguous tensors, not split views")
    p.add_argument("--reps", type=int, default=20, help="calls a round")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each form, alternating")
    args = p.parse_args()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    dev = torch.device("cuda")
    B, T = args.batch, args.seq
    H, HV = QWEN35_27B["linear_num_key_heads"], QWEN35_27B["linear_num_value_heads"]
    K, V = QWEN35_27B["linear_key_head_dim"], QWEN35_27B["linear_value_head_dim"]
    torch.manual_seed(0)
    if args.contiguous:
        q, k = (torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(B, T, HV, V, device=dev, dtype=torch.bfloat16)
    else:
        mixed = torch.randn(B, T, 2 * H * K + HV * V, device=dev, dtype=torch.bfloat16)
        q, k, v = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
        q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, V)
    g = -torch.rand(B, T, HV, device=dev, dtype=torch.float32) * 0.1
    beta = torch.rand(B, T, HV, device=dev, dtype=torch.bfloat16)

    def copied():
        qq, kk = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
        return chunk_gated_delta_rule(qq, kk, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    def grouped():
        return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    a, b = copied(), grouped()
    identical = bool(torch.equal(a, b))
    max_abs_diff = float((a.float() - b.float()).abs().max())
    ms: dict[str, list[float]] = {"copied": [], "grouped": []}
    for _ in range(args.rounds):
        for name, fn in (("copied", copied), ("grouped", grouped)):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(args.reps):
                fn()
            torch.cuda.synchronize()
            ms[name].append((time.perf_counter() - t) / args.reps * 1e3)
    copied_ms, grouped_ms = statistics.median(ms["copied"]), statistics.median(ms["grouped"])
    print(json.dumps({
        "benchmark": "gdn_heads", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["python", *sys.argv]),
        "machine": machine_info(dev),
        "versions": {"torch": torch.__version__, "fla": package_version("flash-linear-attention")},
        "shape": {"batch": B, "seq": T, "key_heads": H, "value_heads": HV, "key_dim": K, "value_dim": V},
        "inputs": "contiguous" if args.contiguous else "split views of the conv output, as transformers passes them",
        "copied_ms": copied_ms, "grouped_ms": grouped_ms, "speedup": copied_ms / grouped_ms,
        "ms_all_rounds": ms, "identical": identical, "max_abs_diff": max_abs_diff}))


if __name__ == "__main__":
    main()
