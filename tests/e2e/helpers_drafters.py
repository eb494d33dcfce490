"""Drafters trained by `dflash train` itself on the responses of the shared target-greedy eval cache
(smollm2_greedy_eval: 5 SmolLM2 responses of <= 24 tokens), then exported: the folders a user serves. Fitted to
those very responses, they accept long chains on them, which is what the live, no-dflash and served checks need:
every block position is exercised."""

from __future__ import annotations

import pathlib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEMO_CONFIG = ROOT / "configs" / "train_smollm2.yaml"


def dflash_trained_drafter(cache_dir, model, out_dir, *, block_size=4, steps=80, lr=3e-3, num_anchors=64,
                           **shape) -> pathlib.Path:
    """`dflash train` (the command) on the cache's own responses; returns its export, out_dir/drafter.

    The config is the demo's (configs/train_smollm2.yaml: 1 layer, SmolLM2's 9 heads / 3 KV heads, intermediate
    1536) with `shape` on top: more TrainConfig fields (num_layers, intermediate_size, num_attention_heads, arch,
    ...), written to a YAML beside out_dir. Measured on the 2-core machine (CPU seconds of the whole command):
      - defaults (block 4, 80 steps of 64 anchors): ~80 CPU-s, tau ~3.5 on the cache (accept lengths 2 / 3 / 4:
        5 / 6 / 23 blocks);
      - block 16, 2 layers, 4 heads / 2 KV heads, intermediate 512, 100 steps of 4 anchors per response at lr 3e-3:
        ~80 CPU-s, token-weighted tau 3.4 / 4.6 / 4.3 (seeds 0 and 1, lr 5e-3), each with whole 16-token blocks
        accepted; 60 steps reached only 1.4 and 8 anchors per step cost twice as much for no gain."""
    from click.testing import CliRunner

    from cli.main import cli

    run = pathlib.Path(out_dir)
    config = DEMO_CONFIG
    if shape:
        config = run.with_name(run.name + ".train.yaml")
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(yaml.safe_dump({**yaml.safe_load(DEMO_CONFIG.read_text()), **shape}))
    res = CliRunner().invoke(cli, ["train", "--cache", str(cache_dir), "--model", str(model), "--output", str(run),
                                   "--config", str(config), "--block-size", str(block_size),
                                   "--num-anchors", str(num_anchors), "--batch-tokens", "2048", "--lr", str(lr),
                                   "--steps", str(steps), "--save-every", str(steps), "--report-to", "none",
                                   "--device", "cpu"], prog_name="dflash")
    assert res.exit_code == 0, res.output
    return run / "drafter"
