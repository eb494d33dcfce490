"""Reconstruction error of the 4-bit storage formats (dflash.cache.quant4) on real hidden states, per tap, against
the bf16 features a bf16 cache stores, with fp8 (dflash.cache.format.quantize_fp8) as the reference point.

Features: the real SmolLM2-135M-Instruct target (dflash.target.assets.smollm2_hf_dir) run through
dflash.target.forward.TappedForward with the default 5 DFlash taps (1, 8, 14, 20, 27), over the first N usable
ShareGPT conversations (their first two turns) tokenized with the chat template as extraction does
(dflash.data.chat), truncated to --max-length tokens. Every sequence starts with the same default system prompt
(24 tokens with its turn header): that shared prefix is counted once, so the statistics are over distinct
contexts. The target runs in float32 on CPU (bf16 matmuls
are ~4x slower there); its features are rounded to bf16, as a bf16 cache stores them, and the bf16 row shows
that rounding's own error against float32 for scale.

Per format and tap: relative L2 error ||x^ - x|| / ||x|| over all tokens of the tap, mean and minimum per-token
cosine; bytes per token on the 27B shape (5 taps x 5120: bf16 51,200 hidden bytes) from quant4.bytes_per_token,
against issue 16's bound (<= 14,340 B/token all in, with input_ids and loss_mask); and the zstd (level 3)
ratio of the stored arrays, for the optional lossless stage. Each 4-bit scheme runs without and with a block
Hadamard rotation (block = the group size, or the largest power of two dividing D=576 when smaller: 64).

Prints a table; the last stdout line is the result JSON, also written to --out.

    python benchmarks/bench_quant_probe.py --conversations 100 --max-length 48 \
        --out benchmarks/results/quant_probe_cpu.json
GPU cost of the format against fp8 (random features, no assets needed):
    python benchmarks/bench_quant_probe.py --device cuda --time-only --time-tokens 16384
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import sys
import time

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import machine_info, package_version  # noqa: E402

SHAPE_27B = dict(num_taps=5, hidden_size=5120)
BOUND_27B = 14_340  # issue 16: <= 0.28x bf16, all in


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=100)
    p.add_argument("--max-length", type=int, default=48, help="tokens per conversation (truncated)")
    p.add_argument("--batch", type=int, default=25, help="sequences per target forward")
    p.add_argument("--groups", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--extra-formats", nargs="*", default=["int4-g32-e4m3-h64", "e2m1-g32-e4m3-h64"],
                   help="more 4-bit formats by name, e.g. a rotation block larger than the group")
    p.add_argument("--device", default="cpu")
    p.add_argument("--time-tokens", type=int, default=0,
                   help="also time encode/decode of random [N, 5, 5120] bf16 features (27B shape) against fp8's "
                        "quantize/dequantize on --device (0: skip; meant for the GPU, e.g. 16384)")
    p.add_argument("--time-only", action="store_true", help="skip the probe (needs no model or data): timing only")
    p.add_argument("--model", default=None, help="SmolLM2 HF folder (default: dflash.target.assets.smollm2_hf_dir())")
    p.add_argument("--time-formats", nargs="+", default=["e2m1-g32-e4m3", "int4-g32-e4m3-h32", "e2m1-g32-e8m0-h32",
                                                          "int4-g64-bf16-h64"])
    p.add_argument("--out", default=None, help="result JSON path (default: print only)")
    return p.parse_args()


def real_features(args, device: torch.device) -> tuple[torch.Tensor, dict]:
    """float32 [T, K, D] tapped features of distinct contexts, plus what was run."""
    from dflash.data.assets import sharegpt_conversations
    from dflash.data.chat import tokenize_conversation
    from dflash.target.assets import smollm2_hf_dir
    from dflash.target.forward import TappedForward
    from dflash.target.load import load_target
    from dflash.target.taps import default_tap_layer_ids

    model, tok = load_target(args.model or smollm2_hf_dir(), device=device, dtype=torch.float32)
    taps = default_tap_layer_ids(model.config.num_hidden_layers)
    seqs = []
    for rec in sharegpt_conversations(4 * args.conversations):
        # the first two turns only: ChatML renders a prefix identically, so when they reach --max-length the
        # window and its loss mask equal the whole conversation's; rendering all turns to cut them cost ~15 s
        r = tokenize_conversation(tok, rec["messages"][:2], max_length=args.max_length)
        if isinstance(r, tuple):
            seqs.append(r)
        if len(seqs) == args.conversations:
            break
    ids = [s[0] for s in seqs]
    prefix = 0  # longest common prefix of all sequences (the template's default system prompt)
    while all(len(s) > prefix and s[prefix] == ids[0][prefix] for s in ids):
        prefix += 1
    tapped = TappedForward(model, taps)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    out, t0 = [], time.perf_counter()
    for b0 in range(0, len(ids), args.batch):
        batch = ids[b0:b0 + args.batch]
        S = max(len(s) for s in batch)
        x = torch.full((len(batch), S), pad, dtype=torch.long)
        for i, s in enumerate(batch):
            x[i, :len(s)] = torch.from_numpy(s.astype(np.int64))
        h = tapped(x.to(device)).float().cpu()  # [B, S, K, D]; right padding needs no mask (causal)
        for i, s in enumerate(batch):
            start = 0 if b0 + i == 0 else prefix
            out.append(h[i, start:len(s)].clone())
    forward_s = time.perf_counter() - t0
    hidden = torch.cat(out)
    info = {"target": "SmolLM2-135M-Instruct (float32 forward)", "tap_layer_ids": list(taps),
            "conversations": len(ids), "max_length": args.max_length, "tokens_run": int(sum(len(s) for s in ids)),
            "shared_prefix_tokens": prefix, "distinct_tokens": int(hidden.shape[0]),
            "loss_tokens_run": int(sum(int(s[1].sum()) for s in seqs)), "forward_s": round(forward_s, 1)}
    return hidden, info


def errors(ref_TKD: torch.Tensor, got_TKD: torch.Tensor) -> dict:
    """Per tap index: relative L2 over all tokens (dominated by the few massive-norm tokens), median per-token
    relative L2 (the typical token, as the drafter's RMSNorm sees it), mean and min per-token cosine."""
    r, g = ref_TKD.double(), got_TKD.double()
    rel = ((g - r).norm(dim=(0, 2)) / r.norm(dim=(0, 2))).tolist()
    per_token = (g - r).norm(dim=2) / r.norm(dim=2).clamp_min(1e-30)  # [T, K]
    cos = torch.nn.functional.cosine_similarity(g, r, dim=-1)  # [T, K]
    return {"rel_l2": rel, "token_rel_l2_median": per_token.median(0).values.tolist(),
            "cos_mean": cos.mean(0).tolist(), "cos_min": cos.min(0).values.tolist()}


def zstd_ratio(arrays: list[np.ndarray]) -> float:
    """Raw bytes / zstd-3 bytes of the stored arrays, compressed one tap at a time (a chunk holds one tap)."""
    from numcodecs import Zstd

    codec, raw, packed = Zstd(level=3), 0, 0
    for a in arrays:
        for k in range(a.shape[1]):
            b = np.ascontiguousarray(a[:, k])
            raw += b.nbytes
            packed += len(codec.encode(b))
    return raw / packed


def time_27b(args, device: torch.device) -> dict:
    """Median seconds of encode and decode (to bf16) per format on a [N, 5, 5120] batch, and their ratio to
    fp8's quantize_fp8 / dequantize_fp8 of the same batch, measured in this run (5 timed calls after 2 warm-up)."""
    from common import sync

    from dflash.cache.format import dequantize_fp8, quantize_fp8
    from dflash.cache.quant4 import decode, encode, parse_quant4

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.time_tokens, SHAPE_27B["num_taps"], SHAPE_27B["hidden_size"], device=device, generator=g)
    x[:, :, torch.randperm(SHAPE_27B["hidden_size"], generator=torch.Generator().manual_seed(0))[:8]] *= 20.0
    x = x.to(torch.bfloat16)

    def median_s(fn) -> float:
        times = []
        for _ in range(7):
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - t)
        return float(np.median(times[2:]))

    bits, scales = quantize_fp8(x)
    fp8_enc, fp8_dec = median_s(lambda: quantize_fp8(x)), median_s(lambda: dequantize_fp8(bits, scales))
    out = {"tokens": args.time_tokens, "fp8": {"encode_s": fp8_enc, "decode_s": fp8_dec}}
    for name in args.time_formats:
        fmt = parse_quant4(name)
        q = encode(x, fmt=fmt, check_finite=False)
        enc = median_s(lambda: encode(x, fmt=fmt, check_finite=False))
        dec = median_s(lambda: decode(q.codes, q.group_scales, q.row_scales, fmt=fmt))
        out[name] = {"encode_s": enc, "decode_s": dec, "encode_vs_fp8": enc / fp8_enc, "decode_vs_fp8": dec / fp8_dec,
                     "encode_tokens_per_s": args.time_tokens / enc, "decode_tokens_per_s": args.time_tokens / dec}
    return out


def rotation_for(group: int, hidden: int) -> int:
    """Rotation block for a group: the group size, capped by the largest power of two dividing D (576: 64)."""
    r = min(group, hidden & -hidden, 128)
    return r if r >= 2 else 0


def probe(args, device: torch.device) -> dict:
    """The per-format, per-tap error table on real features (printed); returns the result fields."""
    from dflash.cache.format import dequantize_fp8, quantize_fp8
    from dflash.cache.quant4 import ELEMENTS, SCALES, Quant4Format, bytes_per_token, decode, encode, parse_quant4

    hidden32, info = real_features(args, device)
    ref = hidden32.to(torch.bfloat16)  # what a bf16 cache holds: the reference
    ref32 = ref.float()
    T, K, D = ref.shape
    rows = []
    rows.append({"storage": "bf16", "bytes_per_token_27b": SHAPE_27B["num_taps"] * SHAPE_27B["hidden_size"] * 2 + 5,
                 "vs": "float32 features", **errors(hidden32, ref32),
                 "zstd_ratio": zstd_ratio([ref.view(torch.uint16).numpy()])})
    bits, scales = quantize_fp8(ref)
    rows.append({"storage": "fp8", "bytes_per_token_27b": SHAPE_27B["num_taps"] * (SHAPE_27B["hidden_size"] + 4) + 5,
                 "vs": "bf16", **errors(ref32, dequantize_fp8(bits, scales, torch.float32)),
                 "zstd_ratio": zstd_ratio([bits.numpy(), scales.numpy()])})
    formats = [Quant4Format(element=element, group_size=group, scale=scale, rotate=rotate)
               for element in ELEMENTS for scale in SCALES for group in args.groups
               for rotate in (0, rotation_for(group, D))]
    formats += [parse_quant4(name) for name in args.extra_formats]
    quant_s = 0.0
    for fmt in formats:
        t = time.perf_counter()
        q = encode(ref, fmt=fmt)
        got = decode(q.codes, q.group_scales, q.row_scales, fmt=fmt, dtype=torch.float32)
        quant_s += time.perf_counter() - t
        stored = [q.codes.numpy(), q.group_scales.numpy()] + ([] if q.row_scales is None else [q.row_scales.numpy()])
        # bytes on the 27B shape: the same format (a rotation block <= 128 divides 5120 too)
        rows.append({"storage": fmt.name, "bytes_per_token_27b": bytes_per_token(fmt, **SHAPE_27B).total,
                     "vs": "bf16", **errors(ref32, got), "zstd_ratio": zstd_ratio(stored)})
    bf16_hidden = SHAPE_27B["num_taps"] * SHAPE_27B["hidden_size"] * 2
    for r in rows:
        r["ratio_vs_bf16_27b"] = round(r["bytes_per_token_27b"] / bf16_hidden, 4)
        r["within_bound_27b"] = r["bytes_per_token_27b"] <= BOUND_27B
        r["rel_l2_mean"] = float(np.mean(r["rel_l2"]))
        r["token_rel_l2_median_mean"] = float(np.mean(r["token_rel_l2_median"]))
        r["cos_mean_all"] = float(np.mean(r["cos_mean"]))
    four = [r for r in rows if r["storage"] not in ("bf16", "fp8")]
    best = min((r for r in four if r["within_bound_27b"]), key=lambda r: r["token_rel_l2_median_mean"])
    fp8 = next(r for r in rows if r["storage"] == "fp8")

    taps = info["tap_layer_ids"]
    head = f"{'storage':<22}{'B/tok 27B':>10}{'x bf16':>8}{'ok':>4}" + "".join(f"{'L2 t' + str(t):>9}" for t in taps)
    head += f"{'tok med':>9}{'cos mean':>10}{'cos min':>9}{'zstd':>6}"
    print(f"{T:,} distinct tokens ({info['tokens_run']:,} run, {info['conversations']} conversations), "
          f"K={K}, D={D}; relative L2 per tap vs {rows[1]['vs']}")
    print(head)
    for r in rows:
        print(f"{r['storage']:<22}{r['bytes_per_token_27b']:>10,}{r['ratio_vs_bf16_27b']:>8.3f}"
              f"{'y' if r['within_bound_27b'] else 'n':>4}" + "".join(f"{v:>9.4f}" for v in r["rel_l2"])
              + f"{r['token_rel_l2_median_mean']:>9.4f}{r['cos_mean_all']:>10.5f}{min(r['cos_min']):>9.4f}"
              f"{r['zstd_ratio']:>6.2f}")
    print(f"lowest typical-token error within {BOUND_27B:,} B/token: {best['storage']} (median per-token relative "
          f"L2 {best['token_rel_l2_median_mean']:.4f}, global {best['rel_l2_mean']:.4f}; fp8 "
          f"{fp8['token_rel_l2_median_mean']:.4f}, {fp8['rel_l2_mean']:.4f})")
    return {
        "features": info, "shape_27b": SHAPE_27B, "bound_27b_bytes_per_token": BOUND_27B,
        "metrics": "rel_l2 (over all tokens) / token_rel_l2_median / cos_mean / cos_min per tap index (taps in "
                   "features.tap_layer_ids order), against the bf16 features (bf16 row: against float32); "
                   "zstd_ratio = raw/zstd-3 bytes of the stored arrays; best_within_bound = lowest "
                   "token_rel_l2_median_mean among 4-bit rows within the bound",
        "rows": rows, "best_within_bound": best["storage"], "quant_seconds_cpu": round(quant_s, 1),
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    device = torch.device(args.device)
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    result = {"bench": "quant_probe", "command": " ".join(["python", "benchmarks/bench_quant_probe.py"] + sys.argv[1:]),
              "machine": machine_info(device), "torch": torch.__version__,
              "transformers": package_version("transformers")}
    if not args.time_only:
        result.update(probe(args, device))
    if args.time_tokens:
        result["timing_27b"] = timing = time_27b(args, device)
        print(f"27B shape, {args.time_tokens:,} tokens on {device}: fp8 encode "
              f"{timing['fp8']['encode_s'] * 1e3:.1f} ms, decode {timing['fp8']['decode_s'] * 1e3:.1f} ms")
        for name in args.time_formats:
            t = timing[name]
            print(f"  {name:<22} encode {t['encode_s'] * 1e3:8.1f} ms ({t['encode_vs_fp8']:.2f}x fp8)  "
                  f"decode {t['decode_s'] * 1e3:8.1f} ms ({t['decode_vs_fp8']:.2f}x fp8)")
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    # a shared CPU stretches wall time: CPU seconds and the 1-minute load average say by how much
    result["cpu_seconds"] = round(ru.ru_utime + ru.ru_stime, 1)
    result["load_average_1min"] = [load_start, os.getloadavg()[0]]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
