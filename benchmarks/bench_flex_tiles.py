"""Flex attention's tile and tuning options on the drafter's block layout (issue 20: "flex attention tile sizes for
the block layout"), forward and backward, at two drafter shapes:

  smollm2  9 heads, 3 KV heads, head_dim 64, 16,384 context tokens a step (the reference quality run's step;
           flex attention is 59 ms of its 138 ms, results/smollm2_step_h200.json)
  27b      32 heads, 8 KV heads, head_dim 128 (the Qwen3.5-27B drafter: configs/train_qwen3.5-27b.yaml), 4,096
           context tokens (bench_train_real's micro-batch)
  hd256    24 heads, 4 KV heads, head_dim 256 (Qwen3.5-27B's own full-attention layers; what "27b" measured until
           2026-12-04, by mistake: no drafter has these heads), 4,096 context tokens

Samples of --min-len..--max-len tokens are packed to the step's context tokens; each sample's anchors are up to
512 of the positions in its last 70% (its response), blocks of 16, the layout and BlockMask the drafter builds
(dflash.train.objective.packed_layout, dflash.drafter.attention.flex_block_mask). Each variant is one
torch.compile of flex_attention (dynamo reset between variants): "default" as the drafter calls it, the
kernel_options rows ("drafter": what flex_block_attention passes, dflash.drafter.attention.flex_kernel_options),
"max-autotune" (mode max-autotune-no-cudagraphs: inductor tries its flex configs), and "expand_kv" (K and V repeated
to the query heads, no GQA in the kernel: what the drafter's training calls do on CUDA at heads above 64 dims,
dflash.drafter.attention.flex_expands_kv).
Reported per shape and variant: median forward and forward+backward ms over --repeats after two warm-up calls,
the first call's seconds (compile, autotune), and TFLOP/s over the visible (query, key) pairs
(4 * pairs * head_dim * heads forward; backward counted as 2.5x forward), plus the largest output difference
and the largest q/k/v gradient difference (relative to the largest element) against the first variant, all
variants backpropagating the same output gradient. A variant that fails records its error and the probe goes on.

    python benchmarks/bench_flex_tiles.py --out benchmarks/results/flex_tiles_h200.json    # CUDA only

2026-12-04, H200 (flex_tiles_h200.json, the variants then, before "drafter" and the bwd_32x64 / bwd_64_s1_w8 rows
were added): at head_dim 64, 64 x 64 forward tiles 1.88 ms against the default's 5.48 (same output), the
backward ~5.6 ms whatever its tiles; max-autotune 1.61 / 6.76 ms after 259 s of autotuning; in the SmolLM2
step, flex attention went from 59.4 to 39.7 ms (smollm2_step_tiles_h200.json). At head_dim 256 (hd256) the
forward is fine (194 TFLOP/s), the backward takes 19.2 of the 21.8 ms and nothing beats inductor's default:
max-autotune picks 64 x 64 / 2 stages / 4 warps at the same 22.0 ms (flex_tiles_hd256_h200.json). At the 27B
drafter's own heads (128 dims) the default is the best tried: 1.60 ms forward (209 TFLOP/s), 8.28 forward +
backward (142 TFLOP/s); max-autotune 8.28 after 137 s; bwd_32x64 14.0 and bwd_64_s1_w8 16.4
(flex_tiles_27b_h200.json). Repeating K and V to the query heads (expand_kv) makes forward + backward 1.19-1.29x
faster at the 27B drafter's heads and is neutral at SmolLM2's (flex_tiles_expand_kv_h200.json).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import error_line, machine_info, timed  # noqa: E402

from dflash.drafter.attention import flex_block_mask, flex_kernel_options  # noqa: E402
from dflash.train.objective import packed_layout  # noqa: E402

SHAPES = {"smollm2": {"heads": 9, "kv_heads": 3, "head_dim": 64, "ctx_tokens": 16384},
          "27b": {"heads": 32, "kv_heads": 8, "head_dim": 128, "ctx_tokens": 4096},
          "hd256": {"heads": 24, "kv_heads": 4, "head_dim": 256, "ctx_tokens": 4096}}
VARIANTS = {
    "default": {},
    "drafter": {"drafter": True},  # what flex_block_attention passes (flex_kernel_options)
    "fwd_m64_n64": {"kernel_options": {"BLOCK_M": 64, "BLOCK_N": 64}},
    "fwd_m128_n128_w8": {"kernel_options": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8}},
    "fwd_m128_n64_s3": {"kernel_options": {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 3, "num_warps": 4}},
    "bwd_64x64": {"kernel_options": {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64}},
    "bwd_32x128": {"kernel_options": {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32}},
    "bwd_32x64": {"kernel_options": {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}},
    "bwd_64_s1_w8": {"kernel_options": {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64,
                                        "num_stages": 1, "num_warps": 8}},
    "max-autotune": {"mode": "max-autotune-no-cudagraphs"},
    # K and V repeated to the query heads (no GQA in the kernel), the repeat and its backward's sum timed too: the
    # backward's dK/dV programs are one per (key tile, KV head), each looping over the group's query heads, and on
    # the block layout the few context tiles carry nearly all the work; per query head there are 4x more programs
    "expand_kv": {"expand_kv": True},
}


def layout_for(ctx_tokens: int, *, min_len: int, max_len: int, num_anchors: int, block_size: int, seed: int,
               device: torch.device):
    g = torch.Generator().manual_seed(seed)
    lengths, anchors, total = [], [], 0
    while True:
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        if total + n > ctx_tokens:
            break
        a = torch.arange(int(0.3 * n), n - 1)
        if a.numel() > num_anchors:
            a = torch.sort(a[torch.randperm(a.numel(), generator=g)[:num_anchors]])[0]
        lengths.append(n)
        anchors.append(a.to(device))
        total += n
    return packed_layout(lengths=lengths, anchors=anchors, block_size=block_size)


def visible_pairs(layout) -> int:
    """(query, key) pairs the mask lets through: a block's B queries see the `anchor` context tokens of their
    sequence below the anchor and the B keys of their own block."""
    B = layout.block_size
    return int((layout.anchor_J.sum() + B * layout.num_blocks) * B)


def run_variant(name: str, spec: dict, q, k, v, bm, repeats: int) -> tuple[dict, tuple | None]:
    import torch._dynamo
    import torch.nn.attention.flex_attention as fa

    torch._dynamo.reset()
    fn = torch.compile(fa.flex_attention, **({"mode": spec["mode"]} if "mode" in spec else {}))
    expand = spec.get("expand_kv", False)
    kw = {"block_mask": bm, "enable_gqa": not expand}
    if "kernel_options" in spec:
        kw["kernel_options"] = spec["kernel_options"]
    elif spec.get("drafter"):
        kw["kernel_options"] = flex_kernel_options(q.shape[-1], q.device.type)
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    # the same output gradient for every variant, so their input gradients compare
    dout = torch.randn(q.shape, dtype=q.dtype, device=q.device,
                       generator=torch.Generator(device=q.device).manual_seed(1))

    group = q.shape[1] // k.shape[1]

    def call():
        if expand:
            return fn(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), **kw)
        return fn(q, k, v, **kw)

    def fwd():
        with torch.no_grad():
            return call()

    def fwd_bwd(keep: bool = False):
        out = call()
        out.backward(dout)
        grads = (q.grad, k.grad, v.grad) if keep else None
        q.grad = k.grad = v.grad = None
        return grads

    try:
        t = time.perf_counter()
        out = fwd()
        grads = fwd_bwd(keep=True)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t
        row = {"first_call_s": round(first_s, 2), "fwd_ms": 1e3 * timed(fwd, q.device, repeats)[0],
               "fwd_bwd_ms": 1e3 * timed(fwd_bwd, q.device, repeats)[0]}
        return row, (out.detach(), grads)
    except Exception as e:  # noqa: BLE001  (a variant the kernel refuses is a result, not the end of the probe)
        return {"error": error_line(e)}, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="smollm2,27b", help=f"comma-separated of {', '.join(SHAPES)}")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated of {', '.join(VARIANTS)}")
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="result JSON (rewritten after every variant)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_flex_tiles: CUDA only (flex attention has no CPU backward)")
    device = torch.device("cuda")
    result = {"probe": "flex_tiles", "command": "python " + " ".join(sys.argv),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(device),
              "torch": torch.__version__, "shapes": {}}
    for shape in args.shapes.split(","):
        sh = SHAPES[shape]
        lay = layout_for(sh["ctx_tokens"], min_len=args.min_len, max_len=args.max_len, num_anchors=args.num_anchors,
                         block_size=args.block_size, seed=args.seed, device=device)
        bm = flex_block_mask(lay)
        Q, K = lay.num_blocks * lay.block_size, lay.num_ctx + lay.num_blocks * lay.block_size
        g = torch.Generator(device=device).manual_seed(args.seed)
        q = torch.randn(1, sh["heads"], Q, sh["head_dim"], device=device, dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, sh["kv_heads"], K, sh["head_dim"], device=device, dtype=torch.bfloat16, generator=g)
                for _ in range(2))
        pairs = visible_pairs(lay)
        fwd_flop = 4 * pairs * sh["head_dim"] * sh["heads"]
        entry = {**sh, "samples": int(lay.ctx_seq_C[-1]) + 1, "Q": Q, "K": K, "visible_pairs": pairs,
                 "fwd_gflop": fwd_flop / 1e9, "variants": {}}
        result["shapes"][shape] = entry
        ref = None
        for name in args.variants.split(","):
            row, out = run_variant(name, VARIANTS[name], q, k, v, bm, args.repeats)
            if "fwd_ms" in row:
                row["fwd_tflop_s"] = fwd_flop / row["fwd_ms"] / 1e9
                row["fwd_bwd_tflop_s"] = 3.5 * fwd_flop / row["fwd_bwd_ms"] / 1e9
                if ref is None:
                    ref = out
                else:
                    row["max_abs_diff_vs_first"] = float((out[0].float() - ref[0].float()).abs().max())
                    # gradients of q, k, v against the first variant's, relative to its largest element
                    row["max_grad_rel_diff_vs_first"] = max(
                        float((a.float() - b.float()).abs().max() / b.float().abs().max())
                        for a, b in zip(out[1], ref[1]))
            row["spec"] = VARIANTS[name]
            entry["variants"][name] = row
            print(f"[bench_flex_tiles] {shape} {name}: {json.dumps(row)}", flush=True)
            pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
