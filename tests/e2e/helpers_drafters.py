"""Drafters that accept a lot on a small target-greedy cache, made in seconds on CPU: dflash's own DFlashDrafter,
blocks (build_blocks, packed_layout) and export, overfit to the cached responses with a cheap cosine loss
between its outputs and the LM-head rows of the labels (the real trainer needs minutes on CPU to get beyond
tau ~1.1). Long accept chains are what the live and served checks need: they exercise every block position."""

from __future__ import annotations

import pathlib

import numpy as np
import torch


def overfit_drafter(cache_dir, model, out_dir, *, block_size=8, num_layers=1, intermediate_size=512, steps=120,
                    lr=3e-3, mask_token_id=16, seed=0, num_attention_heads=4, num_key_value_heads=2):
    """Train a drafter of this shape on every anchor of the cache's responses; export it (float32) to out_dir."""
    from dflash.cache import CacheReader
    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.export import export_drafter
    from dflash.drafter.model import DFlashDrafter
    from dflash.target.head import embedding_and_head
    from dflash.train.objective import build_blocks, packed_layout

    reader = CacheReader(cache_dir)
    taps = reader.tap_layer_ids
    torch.manual_seed(seed)
    B = block_size
    cfg = DrafterConfig(hidden_size=576, intermediate_size=intermediate_size, target_layer_ids=taps,
                        num_target_layers=30, mask_token_id=mask_token_id, vocab_size=49152,
                        num_hidden_layers=num_layers, num_attention_heads=num_attention_heads,
                        num_key_value_heads=num_key_value_heads, head_dim=64,
                        block_size=B)
    dr = DFlashDrafter(cfg)
    embed, head, _ = embedding_and_head(model, dtype=torch.float32)
    packed = reader.read_many(list(range(len(reader))), dequantize=True)
    ids = torch.from_numpy(packed.input_ids.astype(np.int64))
    mask = torch.from_numpy(packed.loss_mask.astype(np.uint8))
    lengths = packed.lengths.tolist()
    offs = np.concatenate([[0], np.cumsum(lengths)])
    anchors, blocks = [], []
    for i, n in enumerate(lengths):
        m = mask[offs[i]: offs[i + 1]]
        a = torch.arange(int(m.nonzero()[0]), n - 1)
        anchors.append(a)
        blocks.append(build_blocks(ids[offs[i]: offs[i + 1]], m, a, block_size=B, mask_token_id=mask_token_id))
    lay = packed_layout(lengths=lengths, anchors=anchors, block_size=B)
    block_ids = torch.cat([b.block_ids_JB for b in blocks]).flatten()
    labels = torch.cat([b.labels_JB for b in blocks]).flatten()
    w = torch.cat([b.weights_JB for b in blocks]).flatten()
    target_dir = torch.nn.functional.normalize(head[labels.clamp(min=0)], dim=-1)
    feats = packed.hidden.float()
    opt = torch.optim.AdamW(dr.parameters(), lr=lr)
    for _ in range(steps):
        out = dr(embed[block_ids], dr.context(feats), q_pos=lay.q_pos_Q, kv_pos=lay.kv_pos_K, mask=lay)
        loss = ((1 - (torch.nn.functional.normalize(out, dim=-1) * target_dir).sum(-1)) * w).sum() / w.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    reader.close()
    return export_drafter(dr.eval(), cfg, out_dir, dtype=torch.float32)


def dflash_trained_drafter(cache_dir, model, out_dir, *, block_size=4, steps=80, lr=3e-3):
    """`dflash train` (the command itself, configs/train_smollm2.yaml: the demo's 1-layer shape) on the cache's
    own responses, then its export: the folder a user serves. 80 steps of 64 anchors at lr 3e-3 overfit the 5
    responses of the shared greedy eval cache to tau ~3.5 (measured accept lengths 2 / 3 / 4: 5 / 6 / 23 blocks),
    so every block position is exercised."""
    from click.testing import CliRunner

    from cli.main import cli

    root = pathlib.Path(__file__).resolve().parents[2]
    run = pathlib.Path(out_dir)
    res = CliRunner().invoke(cli, ["train", "--cache", str(cache_dir), "--model", str(model), "--output", str(run),
                                   "--config", str(root / "configs" / "train_smollm2.yaml"),
                                   "--block-size", str(block_size), "--num-anchors", "64", "--batch-tokens", "2048",
                                   "--lr", str(lr), "--steps", str(steps), "--save-every", str(steps),
                                   "--report-to", "none", "--device", "cpu"], prog_name="dflash")
    assert res.exit_code == 0, res.output
    return run / "drafter"
