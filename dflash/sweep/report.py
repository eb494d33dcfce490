"""Sweep results: one row per run (varied config values, steps, final loss, accuracy per block position,
mean accepted length in training, tau when evaluated) as DIR/results.md and DIR/results.csv, plus PNG plots
(loss curves of all runs; tau, or the final loss when nothing was evaluated, per run), and the best run:
highest tau when every finished run was evaluated, else lowest final loss (a run that diverged ranks nowhere).
Runs that tie on that metric (equal to TIE_REL_TOL) are reported as tied, all named: no single best run is claimed
that the numbers do not show.
Tradeoff: "final loss" is the mean over the last log window of each run (log_every steps), not one step.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import pathlib
from dataclasses import dataclass
from typing import Any

from dflash.sweep.spec import SweepSpec
from dflash.train.unit import DIVERGED_FILE

log = logging.getLogger(__name__)


def _metrics(run_dir: pathlib.Path) -> list[dict]:
    from dflash.train.metrics import read_metrics

    return read_metrics(run_dir)


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "-".join(str(x) for x in v)
    return str(v)


def collect_rows(out: pathlib.Path, spec: SweepSpec) -> list[dict]:
    rows = []
    for r in spec.runs:
        run_dir = pathlib.Path(r.config.output)
        recs = _metrics(run_dir)
        last = recs[-1] if recs else None
        ev = run_dir / "eval.json"
        tau = json.loads(ev.read_text())["tau"] if ev.exists() else None
        # held-out tau measured during training (a spec with eval_cache in its base): the last evaluation
        heldout = next((rec for rec in reversed(recs) if rec.get("heldout_tau") is not None), None)
        diverged = run_dir / DIVERGED_FILE
        row = {"name": r.name, **{k: r.config.to_json()[k] for k in spec.varied},
               "steps": last["step"] if last else 0,
               "finished": (run_dir / "drafter" / "config.json").exists(),
               "diverged_step": json.loads(diverged.read_text())["step"] if diverged.exists() else None,
               "final_loss": last["loss"] if last else None,
               "final_record": last,
               "final_step_loss": last["step_losses"][-1] if last else None,
               "accept_len_train": last["accept_len"] if last else None,
               "tau": tau,
               "heldout_tau": heldout["heldout_tau"] if heldout else None,
               "heldout_step": heldout["step"] if heldout else None,
               "acc": last["acc"] if last else []}
        row["loss_curve"] = [(s, x) for rec in recs
                             for s, x in zip(range(rec["first_step"], rec["step"] + 1), rec["step_losses"])]
        rows.append(row)
    return rows


TIE_REL_TOL = 1e-4
"""Runs whose ranking metric differs by at most this fraction tie: the report prints 4 significant digits, so a
closer difference is one the reader cannot see (and tau or loss differences that small are noise)."""


@dataclass(frozen=True, kw_only=True)
class Ranking:
    """How the runs of a sweep rank on one metric."""

    criterion: str
    """'tau' (every finished run evaluated), 'final_loss', 'none' (no run has a result yet) or
    'none_mixed_losses' (no tau, and the runs' losses are of different methods: arch or objective varies)."""
    leaders: tuple[str, ...] = ()
    """The names of the runs at the best value, in spec order: one name is a best run, several are a tie."""
    value: float | None = None
    """The leaders' metric value (the first leader's)."""

    @property
    def best(self) -> str | None:
        """The single best run's name; None when nothing ranks or the leaders tie."""
        return self.leaders[0] if len(self.leaders) == 1 else None

    def describe(self) -> str:
        """One sentence for results.md and the CLI."""
        crit = self.criterion.replace("_", " ")
        if self.criterion == "none_mixed_losses":
            return ("No ranking: the runs train different losses (arch or objective), so their final losses do not "
                    "compare; give the sweep an eval cache to rank them by tau.")
        if not self.leaders:
            return "No run has results yet."
        if self.best is not None:
            return f"Best run: {self.best} (by {crit})."
        return (f"No single best run: {len(self.leaders)} runs tie on {crit} {self.value:.4g}: "
                f"{', '.join(self.leaders)}.")


def rank_runs(rows: list[dict]) -> Ranking:
    """By tau if every finished run has one (higher is better), else by the final loss (lower is better) when the
    runs train the same loss (rows vary no arch or objective); every run within TIE_REL_TOL of the best value is a
    leader."""
    done = [r for r in rows if r["finished"]] or [r for r in rows if r.get("diverged_step") is None]
    if done and all(r["tau"] is not None and not math.isnan(r["tau"]) for r in done):
        key, scored, sign = "tau", done, -1.0
    elif len({(r.get("arch", "dflash"), r.get("objective")) for r in done}) > 1:
        # a DFlash 2 loss carries the selector term: losses of different methods are different quantities
        return Ranking(criterion="none_mixed_losses")
    else:
        key, sign = "final_loss", 1.0
        scored = [r for r in done if r["final_loss"] is not None and not math.isnan(r["final_loss"])]
    if not scored:
        return Ranking(criterion="none")
    top = min(sign * r[key] for r in scored) * sign
    leaders = tuple(r["name"] for r in scored if math.isclose(r[key], top, rel_tol=TIE_REL_TOL, abs_tol=0.0))
    return Ranking(criterion=key, leaders=leaders, value=top)


def best_run(rows: list[dict]) -> tuple[str | None, str]:
    """(name, criterion) of rank_runs: name None when nothing ranks or the leaders tie."""
    r = rank_runs(rows)
    return r.best, r.criterion


def _table(rows: list[dict], varied: tuple[str, ...]) -> tuple[list[str], list[list[str]]]:
    max_acc = max((len(r["acc"]) for r in rows), default=0)
    head = ["name", *varied, "steps", "finished", "final_loss", "accept_len_train", "tau", "heldout_tau",
            "heldout_step", *[f"acc_{k + 1}" for k in range(max_acc)]]
    body = []
    for r in rows:
        acc = list(r["acc"]) + [None] * (max_acc - len(r["acc"]))
        finished = f"diverged at step {r['diverged_step']}" if r.get("diverged_step") is not None \
            else str(r["finished"]).lower()
        body.append([r["name"], *[_fmt(r[k]) for k in varied], str(r["steps"]), finished,
                     _fmt(r["final_loss"]), _fmt(r["accept_len_train"]), _fmt(r["tau"]), _fmt(r["heldout_tau"]),
                     _fmt(r["heldout_step"]), *[_fmt(a) for a in acc]])
    return head, body


def _plots(out: pathlib.Path, rows: list[dict]) -> list[pathlib.Path]:
    try:
        import matplotlib
    except ImportError:
        log.warning("no plots: matplotlib is not installed (pip install 'dflash[plots]'); tables are written")
        return []

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        if r["loss_curve"]:
            s, x = zip(*r["loss_curve"])
            ax.plot(s, x, label=r["name"], linewidth=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (decay-weighted CE)")
    ax.set_title("sweep: loss per run")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "loss_curves.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    evaluated = [r for r in rows if r["tau"] is not None]
    key, label, fname = (("tau", "tau (exact greedy acceptance length)", "tau.png") if evaluated
                         else ("final_loss", "final loss", "final_loss.png"))
    shown = evaluated or [r for r in rows if r["final_loss"] is not None]
    fig, ax = plt.subplots(figsize=(max(5, 0.6 * len(shown) + 2), 4.5))
    ax.bar(range(len(shown)), [r[key] for r in shown])
    ax.set_xticks(range(len(shown)), [r["name"] for r in shown], rotation=45, ha="right", fontsize=7)
    ax.set_ylabel(label)
    ax.set_title(f"sweep: {label} per config")
    fig.tight_layout()
    paths.append(out / fname)
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def write_report(out: pathlib.Path, spec: SweepSpec) -> tuple[list[dict], str | None]:
    """Write results.md, results.csv and the plots; return the rows and the best run's name (None when the
    leading runs tie: rank_runs(rows) lists them)."""
    rows = collect_rows(out, spec)
    ranking = rank_runs(rows)
    head, body = _table(rows, spec.varied)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(head)
        w.writerows(body)
    plots = _plots(out, rows)
    lines = ["# Sweep results", "",
             f"{len(rows)} runs; varied: {', '.join(spec.varied) or '(nothing)'}.", "",
             f"**{ranking.describe()}**", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    lines += ["", "acc_k: accuracy at block position k over the last log window; final_loss: mean loss of that "
              "window; tau: exact greedy acceptance length of the exported drafter on the sweep's --eval-cache; heldout_tau: "
              "the last held-out tau measured during training (eval_cache in the spec's base), at heldout_step.", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    return rows, ranking.best
