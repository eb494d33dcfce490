"""How evenly a DDP training step's work is spread over the ranks, plain plan vs cost-balanced steps (CPU, seconds).

    python benchmarks/bench_step_balance.py            # writes benchmarks/results/step_balance_cpu.json

Every DDP step waits for its costliest rank, so the compute balance of the plan bounds the scaling efficiency:
bound = total work / (ranks x sum over steps of the costliest rank's work). This measures that bound on a
ShareGPT-size draw (17,600 samples, as bench_extract) of the real ShareGPT token and loss-token lengths
(benchmarks/assets/sharegpt_lengths.json), with the plans dflash train makes (dflash.train.loader.plan_epoch),
without and with the per-sample costs it passes (sample_costs).

A rank's work is counted as the trainer spends it: block tokens (block size x anchors, anchors = min(num_anchors,
loss tokens - 1)) plus context tokens at 1/32 of a block token. The plan's estimate uses the paper's 512 anchors
and block 16 whatever the run uses (one plan serves a sweep), so the bound is also computed for runs with
other anchors/block sizes: the balance must hold when the estimate is not the run's own cost.
It is a plan-level bound, not a timing: GPU kernels that are less efficient on small micro-batches, the
all-reduce and the loader are not in it (bench_scaling measures those on real GPUs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash.train.loader import plan_epoch, sample_costs  # noqa: E402


def balance_bound(plan, w: np.ndarray) -> tuple[float, float]:
    """(efficiency bound, mean over steps of the costliest rank / the mean rank)."""
    total = busiest = 0.0
    ratios = []
    for s in range(plan.num_steps):
        per_rank = plan.rank_costs(s, w)
        total += sum(per_rank)
        busiest += max(per_rank)
        if sum(per_rank):
            ratios.append(max(per_rank) / (sum(per_rank) / plan.world_size))
    return total / (plan.world_size * busiest), float(np.mean(ratios))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=17_600, help="dataset size drawn from the length asset")
    ap.add_argument("--batch-tokens", default="4096,16384", help="micro-batch token budgets (comma-separated)")
    ap.add_argument("--ranks", default="2,4,8", help="world sizes (comma-separated)")
    ap.add_argument("--epochs", type=int, default=2, help="epochs averaged (plans differ per epoch)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "step_balance_cpu.json"))
    args = ap.parse_args(argv)

    asset = json.loads((ROOT / "benchmarks" / "assets" / "sharegpt_lengths.json").read_text())
    pick = np.random.default_rng(args.seed).integers(0, len(asset["lengths"]), size=args.samples)
    lengths = np.asarray(asset["lengths"], dtype=np.int64)[pick]
    loss = np.maximum(1, np.asarray(asset["loss_tokens"], dtype=np.int64)[pick])
    costs = sample_costs(lengths, loss)
    runs = {"anchors512_block16": (512, 16), "anchors256_block16": (256, 16), "anchors512_block8": (512, 8)}
    rows = []
    print(f"{'budget':>7} {'ranks':>5} {'accum':>5} {'run (anchors, block)':>22} {'plain':>7} {'balanced':>9}")
    for bt in (int(x) for x in args.batch_tokens.split(",")):
        for world in (int(x) for x in args.ranks.split(",")):
            for accum in (1, 2):
                for rname, (na, bs) in runs.items():
                    w = sample_costs(lengths, loss, num_anchors=na, block_size=bs)  # the run's own work
                    res = {}
                    for mode, c in (("plain", None), ("balanced", costs)):
                        effs, ratios = zip(*(balance_bound(plan_epoch(lengths, seed=args.seed, epoch=e,
                                                                      batch_tokens=bt, world_size=world,
                                                                      grad_accum=accum, costs=c), w)
                                             for e in range(args.epochs)))
                        res[mode] = {"efficiency_bound": float(np.mean(effs)),
                                     "busiest_over_mean_rank": float(np.mean(ratios))}
                    rows.append({"batch_tokens": bt, "world_size": world, "grad_accum": accum, "run": rname, **res})
                    print(f"{bt:>7} {world:>5} {accum:>5} {rname:>22} {res['plain']['efficiency_bound']:>7.3f} "
                          f"{res['balanced']['efficiency_bound']:>9.3f}")
    result = {"benchmark": "step_balance",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", *sys.argv]) if argv is None else str(argv),
              "machine": {"platform": platform.platform(), "python": platform.python_version()},
              "data": {"asset": asset["source"], "samples": args.samples, "tokens": int(lengths.sum()),
                       "loss_tokens": int(loss.sum())},
              "metric": "efficiency_bound = total work / (ranks x sum over steps of the busiest rank's work)",
              "rows": rows}
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
