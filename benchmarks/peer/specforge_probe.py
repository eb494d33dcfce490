"""Runs in SpecForge's environment (benchmarks/peer/env.py: its tree and .peer/site on PYTHONPATH): tokenizes
a SpecForge-format jsonl ({"conversations": [...]}) with SpecForge's own preprocess_conversations and chat
template, one record at a time, and records the learning rate its trainer uses at each optimizer step
(BF16Optimizer: AdamW + CosineAnnealingWarmupLR with warmup int(ratio * total)). Writes an uncompressed npz:
ids int32, masks uint8, offsets int64 [N+1] (record i = ids[offsets[i]:offsets[i+1]]), lr float64 [steps].

    python benchmarks/peer/specforge_probe.py --model DIR --data X.jsonl --max-length L --steps T
        --warmup-ratio R --lr LR --out OUT.npz
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from env import install_stubs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--model", "--data", "--out"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--chat-template", default="qwen")
    ap.add_argument("--max-length", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup-ratio", type=float, required=True)
    ap.add_argument("--lr", type=float, required=True)
    args = ap.parse_args()
    install_stubs(cpu=os.environ.get("PEER_STUBS_CPU") == "1")
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from specforge.data.preprocessing import preprocess_conversations
    from specforge.data.template import TEMPLATE_REGISTRY
    from specforge.lr_scheduler import CosineAnnealingWarmupLR

    tok = AutoTokenizer.from_pretrained(args.model)
    template = TEMPLATE_REGISTRY.get(args.chat_template)
    ids, masks, offsets = [], [], [0]
    with open(args.data, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            conv = json.loads(line)["conversations"]
            out = preprocess_conversations(tok, [conv], template, max_length=args.max_length)
            ids.append(out["input_ids"][0][0].numpy().astype(np.int32))
            masks.append(out["loss_mask"][0][0].numpy().astype(np.uint8))
            offsets.append(offsets[-1] + len(ids[-1]))
    lrs = []
    if args.steps > 0:  # its scheduler divides by the step count
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.AdamW([p], lr=args.lr, weight_decay=0.0)
        sched = CosineAnnealingWarmupLR(opt, total_steps=args.steps, warmup_steps=int(args.warmup_ratio * args.steps))
        for _ in range(args.steps):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    np.savez(args.out, ids=np.concatenate(ids) if ids else np.zeros(0, np.int32),
             masks=np.concatenate(masks) if masks else np.zeros(0, np.uint8),
             offsets=np.asarray(offsets, np.int64), lr=np.asarray(lrs, np.float64))


if __name__ == "__main__":
    main()
