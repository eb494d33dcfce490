"""Score drafters with z-lab's reference loop: DFlashDraftModel.from_pretrained (missing / unexpected keys
recorded) and dflash_generate(return_stats=True) on the prompts of target-greedy `dflash generate` records.

tau per sequence = generated tokens / verify steps (the mean of its acceptance_lengths), then the mean over
sequences, the definition `dflash eval` uses; `pooled_tau` = all tokens / all steps. Each output is compared
with the record's plain greedy response (same target, same dtype): `equal_fraction` counts identical outputs,
`prefix_fraction` is the mean share of the greedy response that matches before the first difference (bf16
greedy may diverge once the verify forward's batch shape differs from plain decoding).
z-lab's loop times itself with torch.cuda.synchronize (_cuda_time); without CUDA that timer is replaced by
time.perf_counter. It crops its KV caches with DynamicCache.crop(absolute length), which newer transformers (5.24)
refuses ("use a negative integer"); there its DynamicCache is a subclass that turns the length into the number of
tokens to drop. Both only where needed, and reported in `patches`.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import time


def greedy_prompts(path: pathlib.Path, *, limit: int | None) -> list[dict]:
    """prompt ids and greedy response ids of the first `limit` records of a `dflash generate` output."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            meta = rec["dflash_generate"]
            p = int(meta["num_prompt_tokens"])
            out.append({"id": rec.get("id"), "prompt_ids": rec["input_ids"][:p],
                        "response_ids": list(meta["response_ids"]), "max_new_tokens": int(meta["max_new_tokens"])})
            if limit is not None and len(out) == limit:
                break
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def load_zlab_drafter(zlab_mod, drafter_dir: str, *, device, dtype):
    """z-lab's DFlashDraftModel from a drafter folder, with its loading info (missing/unexpected keys)."""
    model, info = zlab_mod.DFlashDraftModel.from_pretrained(drafter_dir, dtype=dtype, output_loading_info=True)
    keys = {k: sorted(info.get(k, [])) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    return model.to(device).eval(), {k: [str(x) for x in v] for k, v in keys.items()}


def absolute_crop_cache(base):
    """`base` (transformers' DynamicCache) when crop(positive length) works, else a subclass translating it."""
    import torch

    probe = base()
    probe.update(torch.zeros(1, 1, 2, 1), torch.zeros(1, 1, 2, 1), 0)
    try:
        probe.crop(1)
        return base, None
    except ValueError:
        pass

    class AbsoluteCropCache(base):
        def crop(self, max_length: int) -> None:
            if max_length >= 0:   # the legacy meaning: keep the first max_length tokens
                drop = self.get_seq_length() - max_length
                if drop <= 0:
                    return
                max_length = -drop
            super().crop(max_length)

    return AbsoluteCropCache, "DynamicCache.crop(absolute length) -> crop(-tokens to drop) (transformers refuses it)"


def score(zlab_mod, *, target, drafter, prompts: list[dict], stop_ids: list[int], device) -> dict:
    """Run z-lab's dflash_generate on every prompt; tau, equality with plain greedy, tokens/s."""
    import torch

    taus, steps, tokens, equal, prefix = [], 0, 0, 0, []
    t0 = time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p["prompt_ids"]], dtype=torch.long, device=device)
        r = zlab_mod.dflash_generate(drafter, target, ids, max_new_tokens=p["max_new_tokens"], stop_token_ids=stop_ids,
                                     temperature=0.0, return_stats=True)
        out = r.output_ids[0, r.num_input_tokens:].tolist()
        acc = list(r.acceptance_lengths)
        taus.append(statistics.mean(acc))
        steps += len(acc)
        tokens += sum(acc)
        equal += out == p["response_ids"]
        prefix.append(common_prefix(out, p["response_ids"]) / max(1, len(p["response_ids"])))
    dt = time.perf_counter() - t0
    return {"tau": statistics.mean(taus) if taus else None, "pooled_tau": tokens / steps if steps else None,
            "sequences": len(prompts), "equal_fraction": equal / len(prompts) if prompts else None,
            "prefix_fraction": statistics.mean(prefix) if prefix else None, "seconds": round(dt, 2),
            "tokens_per_s": tokens / dt if dt > 0 else None}


def run(*, zlab_dir: pathlib.Path, target_dir: str, drafters: dict[str, str], prompt_files: dict[str, pathlib.Path],
        limit: int | None, device: str, dtype: str) -> dict:
    """name -> {keys, per prompt set scores} for every drafter, one target load."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from env import load_zlab_model

    mod = load_zlab_model(zlab_dir)
    patches = []
    if not torch.cuda.is_available():
        mod._cuda_time = time.perf_counter
        patches.append("_cuda_time -> time.perf_counter (no CUDA)")
    mod.DynamicCache, why = absolute_crop_cache(mod.DynamicCache)
    if why:
        patches.append(why)
    tdtype = getattr(torch, dtype)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=tdtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    from dflash.data import end_of_turn_ids

    stop_ids = sorted({*end_of_turn_ids(tok), *([tok.eos_token_id] if tok.eos_token_id is not None else [])})
    sets = {name: greedy_prompts(path, limit=limit) for name, path in prompt_files.items()}
    out = {"patches": patches, "stop_ids": stop_ids, "limit": limit, "drafters": {}}
    for name, ddir in drafters.items():
        drafter, keys = load_zlab_drafter(mod, ddir, device=device, dtype=tdtype)
        res = {"keys": keys, "loads_cleanly": not any(keys.values())}
        for sname, prompts in sets.items():
            res[sname] = score(mod, target=target, drafter=drafter, prompts=prompts, stop_ids=stop_ids, device=device)
        out["drafters"][name] = res
        del drafter
    return out
