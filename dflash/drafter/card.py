"""The model card (README.md) of an exported drafter folder: held-out tau, the training data, the recipe, serving.

A drafter is only as good as its held-out tau on the target's own greedy outputs, and a user deciding whether
to serve it needs that number next to what it was trained on and how, and the commands that serve it. The card is
Markdown under the Hub's YAML front matter (library_name, base_model = the target's Hub id when the target records
one, tags; no license: that is the publisher's call), written atomically into the folder `export_drafter` made (HF
hubs show README.md as the model card); its last section is a JSON block with everything the card was made from, so
a tool can read the numbers back (`read_card_data`) and the card can be rendered again from it (`refresh_model_card`).

The served acceptance appears only when `dflash serve-check` ran on this folder: it records its result in
serve_check.json beside the weights (dflash.serve.record) and renders the card again. An export writes a new folder,
so a re-exported drafter's card shows no served figure until it is checked again.

This module imports nothing above dflash.drafter (layering): it takes plain dicts.
    heldout: one dict per eval cache, as `HeldoutResult.to_json()` (dflash.eval.heldout) or `EvalResult.to_json()`
             (dflash eval) give them, plus optional "name" (the eval set) and "step" (the training step);
    data:    the training cache's manifest.json (fingerprint + totals), or `data_summary(manifest)`;
    recipe:  the resolved training config (TrainConfig as JSON, RUN_DIR/config.json);
    served:  the checks of the folder's serve_check.json (`read_served_checks`; one dict per engine, eval source
             and dtype, as dflash.serve.record writes them).
The training driver calls, after export:
    write_model_card(drafter_dir, heldout=[res.to_json() | {"name": "mtbench", "step": step}, ...],
                     data=json.load(open(cache / "manifest.json")), recipe=cfg_json, target=cfg.model)
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from dflash.drafter.serving import sglang_command, shell_line, vllm_server_argv
from dflash.durable import replace_text
from dflash.errors import ModelNotFoundError

CARD_NAME = "README.md"
SERVE_CHECK_NAME = "serve_check.json"
"""`dflash serve-check`'s record beside the weights ({"checks": [...]}); the card shows what it holds."""
CARD_TAGS = ("dflash", "speculative-decoding")
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
            lines.append(f"| {name} | {s.get('name')} | {step} | {_fmt(s.get('num_sequences'))} | {_fmt(s.get('tau'))} "
                         f"| {_fmt(h.get('exact'))} |")
        overall = h.get("overall", {})
        lines.append(f"| {name} | **all** | {step} | {_fmt(overall.get('num_sequences'))} | **{_fmt(h.get('tau'))}** "
                     f"| {_fmt(h.get('exact'))} |")
    acc = [(h.get("name", "eval"), h.get("acceptance_by_position")) for h in heldout if h.get("acceptance_by_position")]
    if acc:
        width = max(len(a) for _, a in acc)
        lines += ["", "Acceptance per block position (fraction of target steps whose drafts 1..k were all accepted):",
                  "", "| eval set | " + " | ".join(f"k={k}" for k in range(1, width + 1)) + " |",
                  "| --- |" + " --- |" * width]
        lines += [f"| {name} | " + " | ".join(_fmt(x, ".2f") for x in a) + " |" for name, a in acc]
    return lines


def serving_lines(*, target: str, drafter: str, block_size: int) -> list[str]:
    """How to serve the drafter next to its target: vLLM and SGLang, the commands of dflash.drafter.serving (the
    vLLM one is what `dflash serve-check` launches)."""
    vllm = shell_line(vllm_server_argv(target=target, drafter=drafter, block_size=block_size))
    sglang = shell_line(sglang_command(target=target, drafter=drafter, block_size=block_size))
    return ["vLLM (K = block size - 1 drafted tokens per step):", "", "```bash", vllm, "```", "",
            "SGLang (--speculative-num-draft-tokens is the block size):", "", "```bash", sglang, "```", "",
            "Without dflash, with transformers only (the folder's dflash.py; greedy, one prompt at a time):", "",
            "```python", "from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer", "",
            f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(target)})",
            f"target = AutoModelForCausalLM.from_pretrained({json.dumps(target)}, dtype=\"float32\")",
            f"drafter = AutoModel.from_pretrained({json.dumps(drafter)}, trust_remote_code=True, dtype=\"float32\")",
            "messages = [{\"role\": \"user\", \"content\": \"Write a haiku about speculative decoding.\"}]",
            "prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)",
            "tokens, steps = drafter.spec_generate(target, prompt_ids, max_new_tokens=128,",
            "                                      stop_token_ids=[tokenizer.eos_token_id])",
            "print(tokenizer.decode(tokens))",
            "print(\"tokens per target forward:\", sum(steps) / max(len(steps), 1))",
            "```"]


def _served_source(c: Mapping) -> str:
    names = ", ".join(c.get("sources") or ())
    return f"{c.get('eval_source', '-')} ({names})" if names else str(c.get("eval_source", "-"))


def _engine(c: Mapping) -> str:
    return " ".join(str(x) for x in (c.get("engine"), c.get("engine_version")) if x) or "-"


def _verdict(c: Mapping) -> str:
    if c.get("ok"):
        return "yes, exactly" if not c.get("tolerance") else f"yes, within {c['tolerance']}"
    diffs = list(c.get("differences") or ())
    return "no: " + (diffs[0] if diffs else "differs") + (f" (+{len(diffs) - 1} more)" if len(diffs) > 1 else "")


def served_table(checks: Sequence[Mapping]) -> list[str]:
    """Markdown rows of `dflash serve-check` results: engine and version, eval source, dtype, the served mean
    acceptance length beside dflash eval's on the same responses and whether they matched, then the accepted
    count per drafted position."""
    lines = ["Measured by `dflash serve-check`: the drafter served by the engine beside its target, each prompt of "
             "the eval source sent greedily (one request at a time, max_tokens = the cached response's length), the "
             "engine's speculative-decoding counters set beside `dflash eval`'s exact offline chains on the same "
             "responses. Mean acceptance length = 1 + accepted / drafts: tokens per target step, token-weighted.", "",
             "| engine | eval source | requests | dtype | mean acceptance length | dflash eval | drafts | accepted "
             "| matches dflash eval |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in checks:
        s, o = c.get("served", {}), c.get("offline", {})
        lines.append(f"| {_engine(c)} | {_served_source(c)} | {_fmt(c.get('num_requests'))} | {c.get('dtype', '-')} "
                     f"| **{_fmt(s.get('mean_acceptance_length'))}** | {_fmt(o.get('mean_acceptance_length'))} "
                     f"| {_fmt(s.get('num_drafts'))} | {_fmt(s.get('num_accepted_tokens'))} | {_verdict(c)} |")
    per = [(c, c.get("served", {}).get("accepted_per_position") or []) for c in checks]
    width = max((len(p) for _, p in per), default=0)
    if width:
        lines += ["", "Served drafts accepted per position (target steps whose drafted tokens 1..k were all "
                  "accepted):", "", "| engine | eval source | " + " | ".join(f"k={k}" for k in range(1, width + 1))
                  + " |", "| --- | --- |" + " --- |" * width]
        lines += [f"| {_engine(c)} | {_served_source(c)} | " + " | ".join(str(x) for x in p)
                  + " |" * (width - len(p) + 1) for c, p in per]
    sha = sorted({str(c["weights_sha256"]) for c in checks if c.get("weights_sha256")})
    if sha:
        lines += ["", "Checked weights: model.safetensors sha256 " + ", ".join(f"`{h}`" for h in sha) + "."]
    return lines


HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
"""An "org/name" Hugging Face Hub repository id."""


def target_hub_id(target: str | os.PathLike | None) -> str | None:
    """The target's Hub id when the target records one, else None (the card then names no base_model):
    `target` itself when it is an org/name id and not a local folder; a folder of the Hub cache
    (.../models--ORG--NAME/snapshots/REV); or the folder's config.json `_name_or_path` when that is an id."""
    if target is None:
        return None
    text = str(target)
    path = Path(text)
    if HUB_ID.match(text) and not path.exists():
        return text
    for part in reversed(path.resolve().parts if path.exists() else path.parts):
        if part.startswith("models--") and part.count("--") >= 2:
            org, name = part[len("models--"):].split("--", 1)
            return f"{org}/{name}"
    try:
        recorded = json.loads((path / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(recorded, str) and HUB_ID.match(recorded) and not Path(recorded).exists():
        return recorded
    return None


def front_matter(*, base_model: str | None) -> list[str]:
    """The Hub's YAML metadata block: library, base model (when known) and tags; no license (the user's call)."""
    lines = ["---", "library_name: transformers"]
    if base_model:
        lines.append(f"base_model: {base_model}")
    lines += ["tags:"] + [f"- {t}" for t in CARD_TAGS] + ["---", ""]
    return lines


def heldout_from_metrics(records: Sequence[Mapping], *, name: str, step: int | None = None) -> list[dict]:
    """The held-out evaluation of a run's metrics.jsonl (heldout_* fields) at `step` or the last one before it,
    as a card heldout entry; [] when the run logged none. Per-source sequence counts are not in the metrics."""
    evals = [r for r in records if r.get("heldout_tau") is not None and (step is None or r["step"] <= step)]
    if not evals:
        return []
    rec = evals[-1]
    prefix = "heldout_tau/"
    sources = [{"name": k[len(prefix):], "tau": v} for k, v in rec.items() if k.startswith(prefix)]
    return [{"name": name, "step": rec["step"], "tau": rec["heldout_tau"], "exact": True,
             "acceptance_by_position": rec.get("heldout_acc"), "overall": {"num_sequences": rec.get("heldout_sequences")},
             "sources": sources}]


def mixture_table(data: Mapping) -> list[str]:
    """Markdown rows of a mixture run: samples and tokens trained on per cache (the first cache's totals are the
    table above); [] for one cache."""
    seen, tokens = data.get("cache_samples"), data.get("cache_tokens") or {}
    if not seen:
        return []
    total = max(1, sum(seen.values()))
    lines = ["Samples and tokens trained on per cache (a mixture; the table above is the first cache's):", "",
             "| cache | samples seen | share | tokens seen |", "| --- | --- | --- | --- |"]
    lines += [f"| {os.path.basename(str(path).rstrip('/'))} | {n} | {n / total:.3f} | {tokens.get(path, '-')} |"
              for path, n in seen.items()]
    return lines + [""]


def render_card(*, config: Mapping, heldout: Sequence[Mapping], data: Mapping, recipe: Mapping,
                target: str | None = None, drafter_name: str = "DRAFTER_DIR", base_model: str | None = None,
                served: Sequence[Mapping] = (), drafter_id: str | None = None) -> str:
    """The card's Markdown (pure; write_model_card writes it). config: the drafter's config.json; base_model: the
    target's Hub id (front matter and the serving commands), None when unknown; served: serve-check results
    (none: the card says nothing about served acceptance); drafter_id: the name the serving commands use
    instead of drafter_name (the drafter's Hub id), kept in the card data for a re-render."""
    dflash_cfg = config.get("dflash_config", {})
    block = int(config.get("block_size", 16))
    target = target or data.get("target") or "TARGET"
    taus = ", ".join(f"{h.get('name', 'eval')} {_fmt(h.get('tau'))}" for h in heldout) or "not measured"
    lines = front_matter(base_model=base_model) + [f"# DFlash drafter for {target}", "",
             f"A block-diffusion speculative-decoding drafter (DFlash): {config.get('num_hidden_layers')} layers, "
             f"hidden {config.get('hidden_size')}, block size {block}, target layers "
             f"{list(dflash_cfg.get('target_layer_ids', []))}, mask token {dflash_cfg.get('mask_token_id')}. "
             "Trained with dflash from an offline cache of the target's hidden states.", "",
             f"**Held-out tau (exact greedy acceptance length, tokens per target step): {taus}.**", ""]
    if served:
        figures = "; ".join(f"{_engine(c)} ({c.get('dtype', '-')}) on {c.get('eval_source', '-')}: "
                            f"{_fmt(c.get('served', {}).get('mean_acceptance_length'))}, "
                            + ("equal to dflash eval's" if c.get("ok") else "NOT dflash eval's") for c in served)
        lines += [f"**Served mean acceptance length (`dflash serve-check`): {figures}.**", ""]
    lines += ["## Held-out acceptance", ""]
    lines += heldout_table(heldout) if heldout else ["No held-out evaluation was run."]
    srcs = ", ".join(f"{s.get('name')}" for s in data.get("sources", ())) or "-"
    lines += ["", "tau is measured offline on target-greedy eval caches (`dflash generate` + `dflash extract`): "
              "greedy speculative decoding would accept exactly these drafts (`dflash eval`).", ""]
    if served:
        lines += ["## Served acceptance", ""] + served_table(served) + [""]
    lines += ["## Training data", "",
              "| target | samples | tokens | loss tokens | storage | target-greedy | sources |",
              "| --- | --- | --- | --- | --- | --- | --- |",
              f"| {data.get('target')} | {_fmt(data.get('samples'))} | {_fmt(data.get('tokens'))} "
              f"| {_fmt(data.get('loss_tokens'))} | {data.get('storage')} | {data.get('target_greedy')} | {srcs} |", ""]
    lines += mixture_table(data)
    lines += ["## Recipe", "", "| setting | value |", "| --- | --- |"]
    keys = [k for k in RECIPE_KEYS if k in recipe] + sorted(k for k in recipe if k not in RECIPE_KEYS)
    lines += [f"| {k} | {json.dumps(recipe[k]) if isinstance(recipe[k], (dict, list)) else recipe[k]} |" for k in keys]
    lines += ["", "## Serving", ""] + serving_lines(target=base_model or target, drafter=drafter_id or drafter_name,
                                                          block_size=block)
    payload = {"heldout": list(heldout), "data": dict(data), "recipe": dict(recipe), "target": target,
               "base_model": base_model, "drafter_id": drafter_id}
    if served:
        payload["served"] = list(served)
    lines += ["", "## Card data", "", _DATA_MARK, "```json", json.dumps(payload, indent=1, default=str), "```", ""]
    return "\n".join(lines)


def write_model_card(drafter_dir: str | os.PathLike, *, heldout: Sequence[Mapping] | Mapping | None = None,
                     data: Mapping, recipe: Mapping, target: str | None = None, drafter_name: str | None = None
                     ) -> Path:
    """Write README.md into the exported drafter folder (atomic replace); returns its path. drafter_name: how
    the serving commands name the drafter (its Hub id once uploaded); None = the folder's path.

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
                       drafter_name=str(d), drafter_id=drafter_name, base_model=target_hub_id(target),
                       served=read_served_checks(d))
    replace_text(d / CARD_NAME, text)
    return d / CARD_NAME


def read_served_checks(drafter_dir: str | os.PathLike) -> list[dict]:
    """The checks of the folder's serve_check.json ([] when there is none).

    ModelNotFoundError when the file is not what `dflash serve-check` writes."""
    path = Path(drafter_dir) / SERVE_CHECK_NAME
    if not path.is_file():
        return []
    try:
        checks = json.loads(path.read_text())["checks"]
        if not isinstance(checks, list) or not all(isinstance(c, dict) for c in checks):
            raise TypeError("checks is not a list of objects")
    except (ValueError, KeyError, TypeError) as e:
        raise ModelNotFoundError(f"{path} is not a `dflash serve-check` record ({e}): remove it, or run "
                                 "`dflash serve-check` on this drafter again") from e
    return checks


def refresh_model_card(drafter_dir: str | os.PathLike) -> Path | None:
    """Render the folder's dflash card again from its own card data and the current serve_check.json (after a
    serve-check); None when the folder has no card that write_model_card wrote (its README.md is left alone)."""
    d = Path(drafter_dir)
    try:
        old = read_card_data(d)
    except (OSError, IndexError, ValueError):
        return None
    return write_model_card(d, heldout=old.get("heldout") or [], data=old.get("data") or {},
                            recipe=old.get("recipe") or {}, target=old.get("target"),
                            drafter_name=old.get("drafter_id"))


def read_card_data(drafter_dir: str | os.PathLike) -> dict:
    """The JSON block of a card written by write_model_card (heldout, data, recipe, target, base_model,
    drafter_id, and served when a serve-check was recorded)."""
    text = (Path(drafter_dir) / CARD_NAME).read_text()
    block = text.split(_DATA_MARK, 1)[1].split("```json", 1)[1].split("```", 1)[0]
    return json.loads(block)
