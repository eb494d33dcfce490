"""Building the flex-attention BlockMask of one packed training batch: from the layout's structure
(attention.layout_tiles, what the drafter uses) versus evaluating the predicate on every (query, key) pair
(torch.compile'd create_block_mask, what it used before).

    python benchmarks/bench_block_mask.py            # CUDA: up to 16384 context tokens per batch
    python benchmarks/bench_block_mask.py --cpu      # CPU: the pair evaluation is skipped past 1e10 pairs

The batches are shaped like the SmolLM2 quality run's: samples of 64-512 tokens whose last 70% is the
response, every response position an anchor up to --num-anchors, blocks of 16, packed to --batch-tokens
context tokens. Short samples make the query side (anchors x block size) ~10x the context, so the pair count
Q x K grows with the square of the batch. Reported per batch size: Q, K, median seconds of each method
(after a warm-up call that compiles), their ratio, and the visited tiles of each (partial + full).
Writes benchmarks/results/block_mask_<name>.json with the command; the last stdout line is that JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import machine_info, timed  # noqa: E402

from dflash.drafter.attention import TILE, flex_block_mask, layout_mask_mod  # noqa: E402
from dflash.train.objective import packed_layout  # noqa: E402


def batch_layout(batch_tokens: int, *, num_anchors: int, block_size: int, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while True:
        n = int(torch.randint(64, 513, (1,), generator=g))
        if total + n > batch_tokens:
            break
        lengths.append(n)
        total += n
    anchors = []
    for n in lengths:
        first = int(0.3 * n)
        a = torch.arange(first, n - 1)
        if a.numel() > num_anchors:
            a = torch.sort(a[torch.randperm(a.numel(), generator=g)[:num_anchors]])[0]
        anchors.append(a.to(device))
    return packed_layout(lengths=lengths, anchors=anchors, block_size=block_size)


def visited(bm) -> int:
    n = int(bm.kv_num_blocks.sum())
    return n + (int(bm.full_kv_num_blocks.sum()) if bm.full_kv_num_blocks is not None else 0)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is present")
    ap.add_argument("--batch-tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-evaluate-pairs", type=float, default=None,
                    help="skip the pair evaluation above this many Q x K pairs (default: 1e10 on CPU, no limit on CUDA)")
    ap.add_argument("--result-name", default=None, help="results file suffix (default h200 on CUDA, cpu)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    limit = args.max_evaluate_pairs or (1e10 if device.type == "cpu" else float("inf"))
    from torch.nn.attention.flex_attention import create_block_mask

    evaluate = torch.compile(create_block_mask)
    rows = []
    for bt in args.batch_tokens:
        lay = batch_layout(bt, num_anchors=args.num_anchors, block_size=args.block_size, device=device)
        Q = lay.num_blocks * args.block_size
        K = lay.num_ctx + Q
        row = {"batch_tokens": bt, "samples": int(lay.ctx_seq_C[-1]) + 1, "Q": Q, "K": K, "pairs": Q * K}
        s_struct, bm = timed(lambda: flex_block_mask(lay), device, args.repeats)
        row.update(structure_s=s_struct, structure_tiles=visited(bm))
        if Q * K <= limit:
            mod = layout_mask_mod(lay)
            s_eval, bm_e = timed(lambda: evaluate(mod, B=None, H=None, Q_LEN=Q, KV_LEN=K, device=device,
                                                  BLOCK_SIZE=TILE), device, args.repeats)
            row.update(evaluate_s=s_eval, evaluate_tiles=visited(bm_e), speedup=s_eval / s_struct)
        else:
            row.update(evaluate_s=None, evaluate_tiles=None, speedup=None,
                       note=f"pair evaluation skipped: {Q * K:.2e} pairs > {limit:.0e}")
        print(json.dumps(row), flush=True)
        rows.append(row)
    name = args.result_name or ("h200" if device.type == "cuda" else "cpu")
    result = {"benchmark": "bench_block_mask", "name": name,
              "command": "python benchmarks/bench_block_mask.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(device), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
              "num_anchors": args.num_anchors, "block_size": args.block_size, "tile": TILE, "rows": rows}
    out = ROOT / "benchmarks" / "results" / f"block_mask_{name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
