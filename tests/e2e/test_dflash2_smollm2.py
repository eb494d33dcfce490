"""DFlash 2 end to end on the real SmolLM2-135M (CPU, tiny settings): a sweep that trains a DFlash and a DFlash 2
drafter off one read of the shared target-greedy cache (tests/conftest.py smollm2_greedy_eval), held-out exact
tau during training and `dflash eval` of each export in the sweep report. The DFlash 2 loss must fall, and its
exact tau (the selector's drafts through the accept chain) must beat an untrained DFlash 2 drafter of the same
shape on the same cache."""

import csv
import json

import numpy as np
import pytest
import torch

from dflash.train.metrics import read_metrics

pytestmark = pytest.mark.slow
STEPS = 30


def test_sweep_trains_dflash2_beside_dflash_on_smollm2(smollm2_greedy_eval, tmp_path, monkeypatch):
    from dflash.drafter.dflash2 import DFlash2Drafter
    from dflash.drafter.export import load_drafter
    from dflash.drafter.registry import build_drafter
    from dflash.eval.heldout import HeldoutEvaluator
    from dflash.sweep.runner import run_sweep
    from dflash.sweep.spec import spec_from_dict
    from dflash.target.head import embedding_and_head

    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    model, cache = smollm2_greedy_eval.model, str(smollm2_greedy_eval.root / "cache")
    base = dict(mask_token_id=16, num_layers=1, block_size=4, num_anchors=32, intermediate_size=256,
                lr=3e-3, warmup_ratio=0.05, batch_tokens=1024, steps=STEPS, log_every=1, save_every=100,
                selector_rank=16, eval_cache=cache, eval_every=STEPS)
    out = tmp_path / "sw"
    spec = spec_from_dict({"base": base, "grid": {"arch": ["dflash", "dflash2"]}}, cache=cache, model=model,
                          output=str(out))
    run_sweep(spec, output=out, device="cpu", eval_cache=cache)

    recs = read_metrics(out / "runs" / "archdflash2")
    losses = [x for r in recs for x in r["step_losses"]]
    assert len(losses) == STEPS
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    tau = recs[-1]["heldout_tau"]

    # the export is a DFlash 2 drafter, and `dflash eval` of it (the sweep's eval.json) is the held-out tau
    # measured at the last step: one computation, the selector's path through the accept chain
    drafter, dcfg = load_drafter(out / "runs" / "archdflash2" / "drafter", dtype=torch.float32)
    assert type(drafter) is DFlash2Drafter and dcfg.selector_rank == 16
    rows = {r["name"]: r for r in csv.DictReader(open(out / "results.csv"))}
    assert rows["archdflash2"]["tau"] == f"{tau:.4g}" and rows["archdflash2"]["heldout_tau"] == f"{tau:.4g}"
    assert json.loads((out / "runs" / "archdflash2" / "eval.json").read_text())["tau"] == tau
    assert rows["archdflash"]["tau"] != ""  # the DFlash run of the same stream is evaluated too

    torch.manual_seed(0)  # the training run's init (seed 0), untrained
    fresh = build_drafter(dcfg)
    embed, head, _ = embedding_and_head(model, dtype=torch.float32)
    ev = HeldoutEvaluator.from_cache(cache, taps=dcfg.target_layer_ids, device="cpu", model=model)
    untrained = ev.evaluate(fresh, embed_VD=embed, lm_head_VD=head).tau
    print(f"DFlash 2: loss {first:.3f} -> {last:.3f}; exact tau {tau:.3f} vs untrained {untrained:.3f}; "
          f"DFlash tau {rows['archdflash']['tau']}")
    assert last < first - 0.5
    assert tau > untrained
