"""Training metrics: the FLOP model behind MFU, and the sinks (tqdm bar, RUN_DIR/metrics.jsonl, and the reporters of
--report-to: TensorBoard, Weights & Biases; train/reporters.py).

Device-side counters (loss and weight sums, per-position hits, accepted lengths) are accumulated as tensors and
read with one host transfer per log step, so steps between logs never synchronise the host with the GPU.

FLOPs per step (forward + backward, matmuls and attention only; elementwise ops ignored):
  6 x (matmul params of the drafter layers) x (block tokens)
+ 6 x (k_proj + v_proj params, all layers) x (context tokens)    the context is projected to K/V in every layer
+ 6 x (fc params) x (context tokens)
+ 4 x hidden x vocab x (supervised block tokens)                 frozen LM head: forward + input-gradient only
+ 3.5 x 4 x heads x head_dim x (keys visible to block tokens, summed over block tokens and layers)
The attention factor 3.5 = 1 (forward) + 2.5 (backward incl. recompute of scores), times 4 for QK^T and PV (2 each).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

H200_PEAK_BF16 = 790e12   # measured dense bf16 matmul peak of one H200 (DESIGN.md "Performance method")


@dataclass(frozen=True, kw_only=True)
class FlopModel:
    """Parameter counts of one drafter shape that the FLOP formula needs."""

    layer_matmul_params: int     # q,k,v,o,gate,up,down of all drafter layers
    kv_proj_params: int          # k_proj + v_proj of all layers
    fc_params: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    head_dim: int
    num_layers: int

    @classmethod
    def from_config(cls, cfg: Any) -> "FlopModel":
        """From a DrafterConfig (duck-typed: hidden_size, intermediate_size, heads, head_dim, taps, vocab)."""
        H, I, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        nh, nkv, L = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
        attn = H * nh * d * 2 + H * nkv * d * 2
        mlp = 3 * H * I
        return cls(layer_matmul_params=L * (attn + mlp), kv_proj_params=L * 2 * H * nkv * d,
                   fc_params=len(cfg.target_layer_ids) * H * H, hidden_size=H, vocab_size=cfg.vocab_size,
                   num_heads=nh, head_dim=d, num_layers=L)

    def step_flops(self, *, block_tokens: int, context_tokens: int, supervised_tokens: int,
                   visible_keys: int) -> float:
        """FLOPs of one training step; `visible_keys` = sum over block tokens of the keys each one attends to
        (for a block at anchor a: a context keys + B block keys), for one layer."""
        return (6.0 * self.layer_matmul_params * block_tokens
                + 6.0 * self.kv_proj_params * context_tokens
                + 6.0 * self.fc_params * context_tokens
                + 4.0 * self.hidden_size * self.vocab_size * supervised_tokens
                + 3.5 * 4.0 * self.num_heads * self.head_dim * visible_keys * self.num_layers)


class MetricSink:
    """Writes log records to RUN_DIR/metrics.jsonl (append, flushed per record), to the reporters of report_to
    (train.reporters.open_reporters: None = TensorBoard when installed), and a tqdm progress bar on rank 0.
    Other ranks get a sink that does nothing."""

    def __init__(self, run_dir: str | os.PathLike, *, enabled: bool, total_steps: int, initial_step: int,
                 progress: bool = True, report_to: tuple[str, ...] | None = None,
                 config: dict[str, Any] | None = None) -> None:
        self.enabled = enabled
        self._heldout: dict[str, str] = {}
        self._jsonl = None
        self._reporters: list = []
        self._bar = None
        if not enabled:
            return
        from dflash.train.reporters import open_reporters

        run = pathlib.Path(run_dir)
        run.mkdir(parents=True, exist_ok=True)
        self._reporters = open_reporters(report_to, run, config or {})
        self._jsonl = open(run / "metrics.jsonl", "a", encoding="utf-8")
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True,
                             desc="train")

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(record, allow_nan=True) + "\n")
        self._jsonl.flush()
        if self._reporters:
            from dflash.train.interrupted import interrupts_deferred
            from dflash.train.reporters import flat_scalars

            scalars = flat_scalars(record)
            with interrupts_deferred():   # their writer threads' queues must not be cut mid-put
                for reporter in self._reporters:
                    reporter.log(scalars, record["step"])
        if self._bar is not None:
            post = {"loss": f"{record['loss']:.4f}", "acc1": f"{record['acc'][0]:.3f}",
                    "tau": f"{record['accept_len']:.2f}", "tok/s": f"{record['tokens_per_s']:.0f}",
                    "stall": f"{record['stall_frac']:.2f}"}
            if record.get("mfu") is not None:
                post["mfu"] = f"{record['mfu']:.3f}"
            if record.get("heldout_tau") is not None:  # the last evaluation stays on the line until the next
                self._heldout = {"heldout_tau": f"{record['heldout_tau']:.3f}",
                                 "train/heldout": f"{record['train_over_heldout']:.2f}"
                                 if record.get("train_over_heldout") is not None else "-"}
            post.update(self._heldout)
            if record.get("cache_samples"):  # a mixture: the share of samples seen per cache so far
                seen = list(record["cache_samples"].values())
                post["mix"] = "/".join(f"{n / max(1, sum(seen)):.2f}" for n in seen)
            self._bar.set_postfix(post, refresh=False)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        for reporter in self._reporters:
            reporter.close()
        self._bar = self._jsonl = None
        self._reporters = []


class Stopwatch:
    """Wall time between log steps, on the host (the log step's .item() sync makes it cover the GPU work).
    pause/resume leave out a stretch (a held-out evaluation) from the current lap."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self._paused: float | None = None

    def lap(self) -> float:
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt

    def pause(self) -> None:
        self._paused = time.perf_counter()

    def resume(self) -> None:
        assert self._paused is not None, "resume without pause"
        self.t += time.perf_counter() - self._paused
        self._paused = None


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of RUN_DIR/metrics.jsonl (for tests and tools)."""
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise
            # the last line of a run killed while writing it (e.g. a call cut at its time limit): left out
    return records


def describe_final_loss(record: dict[str, Any] | None) -> str:
    """"final loss" in the words `dflash train` and `dflash sweep` both print: the mean loss of the last log
    window (the metrics record's `loss`), with its steps; one step's loss is noisier (anchors differ per step)."""
    if record is None:
        return "final loss - (no step logged)"
    steps = (f"step {record['step']}" if record["first_step"] == record["step"]
             else f"steps {record['first_step']}-{record['step']}")
    return f"final loss {record['loss']:.4f} (mean of {steps}, the last log window)"
