"""The exported drafter works where dflash is not installed: a subprocess in which `import dflash` fails loads it
with AutoModel.from_pretrained(trust_remote_code=True) (the folder's dflash.py), runs greedy speculative decoding
with the real SmolLM2 target (transformers only) on the target-greedy eval prompts, and must give the target's
greedy responses and, per prompt, exactly the accept chain of `dflash eval` on the cache of those responses. The
model card's transformers-only example runs there as written and gives the target's greedy output.

The drafter is trained by `dflash train` on the cached responses themselves (the session's smollm2_trained_drafter,
tau ~3.5 there) so that long accept chains occur; a drafter that accepts nothing would match any loader.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import numpy as np
import torch
from click.testing import CliRunner

from cli.main import cli

import pytest

pytestmark = pytest.mark.slow

# Runs under `python -I` with site-packages on sys.path but no .pth processing (-S), and a meta-path hook that
# refuses dflash, so neither an editable nor a regular install of dflash is reachable.
CHILD = textwrap.dedent(r'''
    import importlib.abc, json, sys
    sys.path.append(sys.argv[1])

    class NoDflash(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "dflash" or name.startswith("dflash."):
                raise ModuleNotFoundError(f"No module named {name!r} (not installed here)")
            return None

    sys.meta_path.insert(0, NoDflash())
    try:
        import dflash  # noqa: F401
        dflash_importable = True
    except ModuleNotFoundError:
        dflash_importable = False

    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    job = json.loads(open(sys.argv[2]).read())
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(job["target"], dtype=torch.float32).eval()
    drafter = AutoModel.from_pretrained(job["drafter"], trust_remote_code=True, dtype=torch.float32).eval()
    results = []
    for prompt in job["prompts"]:
        tokens, steps = drafter.spec_generate(target, prompt, max_new_tokens=job["max_new_tokens"],
                                              stop_token_ids=job["stop_ids"])
        results.append({"tokens": tokens, "steps": steps})

    # the model card's transformers-only example, as written, then plain greedy generation of its prompt
    card = open(job["card"]).read().split("Without dflash", 1)[1]
    snippet = card.split("```python\n", 1)[1].split("\n```", 1)[0]
    ns = {}
    exec(snippet, ns)
    out = ns["target"].generate(torch.tensor([ns["prompt_ids"]]), max_new_tokens=128, do_sample=False,
                                eos_token_id=ns["tokenizer"].eos_token_id)
    card_run = {"tokens": ns["tokens"], "steps": ns["steps"], "generate": out[0, len(ns["prompt_ids"]):].tolist()}
    print(json.dumps({"card": card_run, "dflash_importable": dflash_importable, "module": type(drafter).__module__,
                      "dflash_modules": sorted(m for m in sys.modules if m == "dflash" or m.startswith("dflash.")),
                      "results": results}))
''')


def test_exported_drafter_decodes_without_dflash(smollm2_greedy_eval, smollm2_trained_drafter, tmp_path):
    from dflash.cache import CacheReader
    from dflash.drafter.card import write_model_card
    from dflash.drafter.export import load_drafter
    from dflash.eval.generate import stop_token_ids
    from dflash.eval.tau import sequence_steps
    from dflash.target.head import embedding_and_head
    from dflash.target.load import load_target

    root, model, records = smollm2_greedy_eval.root, smollm2_greedy_eval.model, smollm2_greedy_eval.records
    drafter_dir = shutil.copytree(smollm2_trained_drafter, tmp_path / "drafter")   # the card is written below
    assert (drafter_dir / "dflash.py").is_file()

    res = CliRunner().invoke(cli, ["eval", "--drafter", str(drafter_dir), "--cache", str(root / "cache"), "--model",
                                   model, "--json", "--device", "cpu", "--chunk-anchors", "16"], prog_name="dflash")
    assert res.exit_code == 0, res.output
    evaluated = json.loads(res.output)
    assert evaluated["exact"] is True

    # dflash eval's chain per cached sequence (the per-sequence view of the counts it printed)
    dr, cfg = load_drafter(drafter_dir, dtype=torch.float32)
    embed, head, _ = embedding_and_head(model, dtype=torch.float32)
    reader = CacheReader(root / "cache")
    cached = []
    for i in range(len(reader)):
        s = reader.read(i, taps=cfg.target_layer_ids, dequantize=True)
        ids = s.input_ids.astype(np.int64)
        with torch.no_grad():
            steps = sequence_steps(dr.eval(), embed_VD=embed, lm_head_VD=head, input_ids_T=torch.from_numpy(ids),
                                   hidden_TKD=s.hidden.float(), loss_mask_T=s.loss_mask,
                                   mask_token_id=cfg.mask_token_id)
        cached.append((ids.tolist(), steps))
    reader.close()
    counts = np.bincount([k for _, steps in cached for k in steps], minlength=cfg.block_size + 1)
    assert {str(k): int(c) for k, c in enumerate(counts) if k and c} == \
        {k: c for k, c in evaluated["overall"]["accept_length_counts"].items() if c}

    _, tok = load_target(model, device="cpu", dtype=torch.float32)
    from transformers import GenerationConfig

    stops = stop_token_ids(tok, GenerationConfig.from_pretrained(model), {})
    prompts = [r["input_ids"][: r["dflash_generate"]["num_prompt_tokens"]] for r in records]
    job = tmp_path / "job.json"
    write_model_card(drafter_dir, data={}, recipe={}, target=model)
    job.write_text(json.dumps({"target": model, "drafter": str(drafter_dir), "prompts": prompts,
                               "card": str(drafter_dir / "README.md"),
                               "max_new_tokens": smollm2_greedy_eval.max_new_tokens, "stop_ids": sorted(stops)}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "hf_modules")
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", CHILD, sysconfig.get_paths()["purelib"], str(job)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    assert child["dflash_importable"] is False and child["dflash_modules"] == []
    assert child["module"].startswith("transformers_modules.") and child["module"].endswith(".dflash")

    by_ids = {tuple(ids): steps for ids, steps in cached}
    assert len(by_ids) == len(records)
    all_steps = []
    for rec, got in zip(records, child["results"]):
        assert got["tokens"] == rec["dflash_generate"]["response_ids"], "not the target's greedy output"
        assert got["steps"] == by_ids[tuple(rec["input_ids"])], "accept chain differs from dflash eval's"
        all_steps += got["steps"]
    assert np.mean(all_steps) > 1.8, "the trained drafter should give long accept chains"
    # the card's example decodes a new prompt to exactly the target's greedy output
    card = child["card"]
    assert card["tokens"] == card["generate"] and len(card["tokens"]) > 1 and card["steps"]
