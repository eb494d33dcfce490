"""The end of an optimizer step on the 27B drafter's parameters: normalise, clip, AdamW, before and after the
clip and the normaliser were folded into one divisor (dflash.train.step.apply_divisor), in one run.

    python benchmarks/bench_step_tail.py            # CUDA: all 5 layers (1.73B fp32 parameters, ~28 GB)
    python benchmarks/bench_step_tail.py --layers 1 # CPU: one layer (0.45B parameters, ~7 GB)
    python benchmarks/bench_step_tail.py --tiny     # a smoke run of the script (hidden 256)

Both forms run on the same parameters, flat fp32 gradient buffer (train.step.GradSync) and optimizer
(train.unit.build_optimizer: the fused AdamW, on CUDA and CPU), alternating, after one
untimed step each. Before each timed step the gradient is refilled (outside the clock) with a norm above the
clip, as in every log window of the SmolLM2 reference run:
- before: grads.div_(weight sum); torch.nn.utils.clip_grad_norm_(params, 1.0); optimizer.step()
- after:  GradSync.norm_and_divisor; apply_divisor (the divisor as the fused kernel's grad_scale);
          optimizer.step()
Reports the median seconds of each (device-synchronised), the difference, and on CUDA that difference as a
fraction of bench_train_real's step (train_real_lengths_h200.json run_a.step_time_s). The parameter count
scales every term, so --layers 1 gives the same per-parameter costs. Writes
benchmarks/results/step_tail_<cpu|h200>.json; the last stdout line is that JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import machine_info, sync  # noqa: E402


def build(layers: int, device: torch.device, *, tiny: bool = False):
    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.model import DFlashDrafter
    from dflash.train.config import TrainConfig
    from dflash.train.step import GradSync
    from dflash.train.unit import build_optimizer

    width = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64) if tiny else dict(hidden_size=5120, intermediate_size=17408)
    dc = DrafterConfig(**width, target_layer_ids=(1, 16, 31, 46, 61), num_target_layers=64, mask_token_id=248070,
                       vocab_size=248320, num_hidden_layers=layers)
    with torch.device(device):
        drafter = DFlashDrafter(dc)
    params = [p for p in drafter.parameters() if p.requires_grad]
    sync_ = GradSync(params, block_size=dc.block_size, device=device)
    opt = build_optimizer(params, TrainConfig(cache="-", model="-", output="-"), device)
    return params, sync_, opt


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None, help="drafter layers (default: 5 on CUDA, 1 on CPU)")
    ap.add_argument("--tiny", action="store_true", help="hidden 256 (a smoke run of the script, no timing)")
    ap.add_argument("--reps", type=int, default=10, help="timed steps per form, alternating")
    ap.add_argument("--json", default=None, help="result path (default benchmarks/results/step_tail_<name>.json)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers = args.layers or (5 if device.type == "cuda" else 1)
    from dflash.train.step import apply_divisor

    params, gs, opt = build(layers, device, tiny=args.tiny)
    num_params = gs.num_params
    gen = torch.Generator(device=device).manual_seed(0)
    weight_sum = 3000.0  # a step's supervised weight, order of magnitude; the clip is active at any value here

    def refill() -> None:
        gs.grads.normal_(generator=gen)
        gs.counters[1] = weight_sum
        sync(device)

    def before() -> None:
        opt.grad_scale = None  # after() leaves its divisor there; the optimizer reads it on every step
        gs.grads.div_(gs.counters[1].clamp(min=1e-12))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    def after() -> None:
        gs.reduce(1)
        _, divisor = gs.norm_and_divisor(max_norm=1.0)
        apply_divisor(opt, gs.grads, divisor)
        opt.step()

    forms = {"before": before, "after": after}
    secs: dict[str, list[float]] = {k: [] for k in forms}
    for rep in range(args.reps + 1):
        for name, fn in (forms.items() if rep % 2 == 0 else reversed(forms.items())):
            refill()
            t0 = time.perf_counter()
            fn()
            sync(device)
            if rep > 0:  # the first is a warm-up (optimizer state allocation)
                secs[name].append(time.perf_counter() - t0)
        print(f"[bench_step_tail] rep {rep}: " + "  ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in secs.items() if v),
              flush=True)
    med = {k: statistics.median(v) for k, v in secs.items()}
    name = "tiny_cpu" if args.tiny else "h200" if device.type == "cuda" else "cpu"
    out = {"bench": "step_tail", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
           "machine": machine_info(device), "versions": {"torch": torch.__version__},
           "tiny": args.tiny, "layers": layers, "num_params": num_params, "optimizer": type(opt).__name__,
           "fused": bool(opt.defaults.get("fused")),
           "ms_before": med["before"] * 1e3, "ms_after": med["after"] * 1e3,
           "saved_ms": (med["before"] - med["after"]) * 1e3, "after_over_before": med["after"] / med["before"],
           "ms_per_billion_params": {k: v * 1e3 / (num_params / 1e9) for k, v in med.items()},
           "seconds_all_reps": secs}
    real = ROOT / "benchmarks/results/train_real_lengths_h200.json"
    if device.type == "cuda" and layers == 5 and not args.tiny and real.exists():
        step_s = json.loads(real.read_text())["workloads"]["real"]["run_a"]["step_time_s"]
        out["saved_fraction_of_real_lengths_step"] = (med["before"] - med["after"]) / step_s
        out["real_lengths_step_s"] = step_s
    path = pathlib.Path(args.json or ROOT / f"benchmarks/results/step_tail_{name}.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
