"""The model card (README.md) of an exported drafter folder: held-out tau, the training data, the recipe, serving.

A drafter is only as good as its held-out tau on the target's own greedy outputs, and a user deciding whether
to serve it needs that number next to what it was trained on and how. The card is plain Markdown written
atomically into the folder `export_drafter` made (HF hubs show README.md as the model card); its last section is
a JSON block with everything the card was made from, so a tool can read the numbers back (`read_card_data`).

This module imports nothing above dflash.drafter (layering): it takes plain dicts.
    heldout: one dict per eval cache, as `HeldoutResult.to_json()` (dflash.eval.heldout) or `EvalResult.to_json()`
             (dflash eval) give them, plus optional "name" (the eval set) and "step" (the training step);
    data:    the training cache's manifest.json (fingerprint + totals), or `data_summary(manifest)`;
    recipe:  the resolved training config (TrainConfig as JSON, RUN_DIR/config.json).
The training driver calls, after export:
    write_model_card(drafter_dir, heldout=[res.to_json() | {"name": "mtbench", "step": step}, ...],
                     data=json.load(open(cache / "manifest.json")), recipe=cfg_json, target=cfg.model)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from dflash.durable import replace_text
from dflash.errors import ModelNotFoundError

CARD_NAME = "README.md"
_DATA_MARK = "<!-- dflash-card-data -->"
RECIPE_KEYS = ("steps", "epochs", "lr", "warmup_ratio", "batch_tokens", "grad_accum", "num_anchors", "block_size",
               "gamma", "loss_normalization", "anchor_positions", "num_layers", "seed", "dtype", "storage", "online",
               "noise", "eval_every")


def data_summary(manifest: Mapping) -> dict:
    """What the card says about the training data, from a cache manifest (or an already made summary)."""
    if "fingerprint" not in manifest:
        return dict(manifest)
    fp, totals = manifest["fingerprint"], manifest.get("totals", {})
    return {"target": fp.get("target"), "target_config_hash": fp.get("target_config_hash"),
            "samples": totals.get("samples"), "tokens": totals.get("tokens"), "loss_tokens": totals.get("loss_tokens"),
            "storage": fp.get("storage"), "tap_layer_ids": list(fp.get("tap_layer_ids", ())),
            "max_length": fp.get("max_length"), "target_greedy": fp.get("target_greedy"),
            "sources": [{"name": os.path.basename(str(s.get("path", "")).rstrip("/")), "sha256": s.get("sha256")}
                        for s in fp.get("sources", ())]}


def _fmt(x, spec: str = ".3f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def heldout_table(heldout: Sequence[Mapping]) -> list[str]:
    """Markdown rows: eval set, source, sequences, tau (exact greedy), then acceptance per block position."""
    lines = ["| eval set | source | step | sequences | tau | exact |", "| --- | --- | --- | --- | --- | --- |"]
    for h in heldout:
        name, step = h.get("name", "eval"), _fmt(h.get("step"))
        for s in h.get("sources", ()):
            lines.append(f"| {name} | {s.get('name')} | {step} | {s.get('num_sequences')} | {_fmt(s.get('tau'))} "
                         f"| {h.get('exact')} |")
        overall = h.get("overall", {})
        lines.append(f"| {name} | **all** | {step} | {overall.get('num_sequences')} | **{_fmt(h.get('tau'))}** "
                     f"| {h.get('exact')} |")
    acc = [(h.get("name", "eval"), h.get("acceptance_by_position")) for h in heldout if h.get("acceptance_by_position")]
    if acc:
        width = max(len(a) for _, a in acc)
        lines += ["", "Acceptance per block position (fraction of target steps whose drafts 1..k were all accepted):",
                  "", "| eval set | " + " | ".join(f"k={k}" for k in range(1, width + 1)) + " |",
                  "| --- |" + " --- |" * width]
        lines += [f"| {name} | " + " | ".join(_fmt(x, ".2f") for x in a) + " |" for name, a in acc]
    return lines


def serving_lines(*, target: str, drafter: str, block_size: int) -> list[str]:
    """How to serve the drafter next to its target: vLLM and SGLang, the commands of dflash.drafter.serving
    (the vLLM one is what `dflash serve-check` launches)."""
    from dflash.drafter.serving import shell_command, sglang_server_argv, vllm_server_argv

    args = dict(target=target, drafter=drafter, block_size=block_size)
    return ["```bash", shell_command(vllm_server_argv(**args)), "```", "", "```bash",
            shell_command(sglang_server_argv(**args)), "```"]


def render_card(*, config: Mapping, heldout: Sequence[Mapping], data: Mapping, recipe: Mapping,
                target: str | None = None, drafter_name: str = "DRAFTER_DIR") -> str:
    """The card's Markdown (pure; write_model_card writes it). config: the drafter's config.json."""
    dflash_cfg = config.get("dflash_config", {})
    block = int(config.get("block_size", 16))
    target = target or data.get("target") or "TARGET"
    taus = ", ".join(f"{h.get('name', 'eval')} {_fmt(h.get('tau'))}" for h in heldout) or "not measured"
    lines = [f"# DFlash drafter for {target}", "",
             f"A block-diffusion speculative-decoding drafter (DFlash): {config.get('num_hidden_layers')} layers, "
             f"hidden {config.get('hidden_size')}, block size {block}, target layers "
             f"{list(dflash_cfg.get('target_layer_ids', []))}, mask token {dflash_cfg.get('mask_token_id')}. "
             "Trained with dflash from an offline cache of the target's hidden states.", "",
             f"**Held-out tau (exact greedy acceptance length, tokens per target step): {taus}.**", "",
             "## Held-out acceptance", ""]
    lines += heldout_table(heldout) if heldout else ["No held-out evaluation was run."]
    srcs = ", ".join(f"{s.get('name')}" for s in data.get("sources", ())) or "-"
    lines += ["", "tau is measured offline on target-greedy eval caches (`dflash generate` + `dflash extract`): "
              "greedy speculative decoding would accept exactly these drafts (`dflash eval`).", "",
              "## Training data", "",
              "| target | samples | tokens | loss tokens | storage | target-greedy | sources |",
              "| --- | --- | --- | --- | --- | --- | --- |",
              f"| {data.get('target')} | {_fmt(data.get('samples'))} | {_fmt(data.get('tokens'))} "
              f"| {_fmt(data.get('loss_tokens'))} | {data.get('storage')} | {data.get('target_greedy')} | {srcs} |", "",
              "## Recipe", "", "| setting | value |", "| --- | --- |"]
    keys = [k for k in RECIPE_KEYS if k in recipe] + sorted(k for k in recipe if k not in RECIPE_KEYS)
    lines += [f"| {k} | {json.dumps(recipe[k]) if isinstance(recipe[k], (dict, list)) else recipe[k]} |" for k in keys]
    lines += ["", "## Serving", ""] + serving_lines(target=target, drafter=drafter_name, block_size=block)
    payload = {"heldout": list(heldout), "data": dict(data), "recipe": dict(recipe), "target": target}
    lines += ["", "## Card data", "", _DATA_MARK, "```json", json.dumps(payload, indent=1, default=str), "```", ""]
    return "\n".join(lines)


def write_model_card(drafter_dir: str | os.PathLike, *, heldout: Sequence[Mapping] | Mapping | None = None,
                     data: Mapping, recipe: Mapping, target: str | None = None) -> Path:
    """Write README.md into the exported drafter folder (atomic replace); returns its path.

    ModelNotFoundError when drafter_dir has no config.json (not an exported drafter)."""
    d = Path(drafter_dir)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ModelNotFoundError(f"{d} is not an exported drafter folder (no config.json): export it first")
    config = json.loads(cfg_path.read_text())
    if heldout is None:
        heldout = []
    elif isinstance(heldout, Mapping):
        heldout = [heldout]
    text = render_card(config=config, heldout=list(heldout), data=data_summary(data), recipe=recipe, target=target,
                       drafter_name=str(d))
    replace_text(d / CARD_NAME, text)
    return d / CARD_NAME


def read_card_data(drafter_dir: str | os.PathLike) -> dict:
    """The JSON block of a card written by write_model_card (heldout, data, recipe, target)."""
    text = (Path(drafter_dir) / CARD_NAME).read_text()
    block = text.split(_DATA_MARK, 1)[1].split("```json", 1)[1].split("```", 1)[0]
    return json.loads(block)
