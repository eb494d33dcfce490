"""`dflash eval`: exact greedy acceptance length (tau) of a drafter on a target-greedy eval cache."""

import json

import click

from cli.cache_cmd import store_mirror_option


@click.command("eval")
@click.option("--drafter", "drafter_dir", required=True, type=click.Path(file_okay=False),
              help="Drafter folder (dflash export / published DFlash drafter).")
@click.option("--cache", "cache_dir", required=True, type=click.Path(file_okay=False),
              help="Eval cache from `dflash extract` of `dflash generate` output.")
@click.option("--model", "model_path", required=True, help="The target (for its frozen embedding and LM head).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--approximate", is_flag=True,
              help="Allow a cache whose responses are not the target's greedy outputs (tau is then approximate).")
@click.option("--chunk-anchors", default=None, type=int,
              help="Blocks per drafter forward (default: held-out eval's, dflash.eval.batched.DEFAULT_CHUNK_ANCHORS; "
                   "the same value gives bit-identical tau).")
@click.option("--limit", default=None, type=int, help="Evaluate only the first N sequences.")
@click.option("--device", default=None, help="cuda / cpu (default: cuda when available).")
@store_mirror_option
@click.option("--dtype", default=None, type=click.Choice(["bfloat16", "float16", "float32"]),
              help="Drafter dtype (default: bfloat16 on GPU, float32 on CPU).")
def command(drafter_dir, cache_dir, model_path, as_json, approximate, chunk_anchors, limit, device, store_mirror,
            dtype) -> None:
    """Exact greedy tau: walk the accept chain of every cached response (per source and overall)."""
    from dflash.eval.evaluate import EvalConfig, evaluate_cache, format_result

    from dflash.store.resolve import reader_path

    cache_dir = reader_path(cache_dir, mirror=store_mirror)  # a URL is read directly unless --store-mirror
    cfg = EvalConfig(chunk_anchors=chunk_anchors, approximate=approximate, device=device, dtype=dtype, limit=limit)
    from cli.interrupt import command_line, exits_on_interrupt

    def describe(_interrupt) -> str:  # eval writes nothing: there is nothing to keep or resume
        return f"interrupted: eval writes nothing, so nothing is lost but its time; run it again with: {command_line()}"

    with exits_on_interrupt(describe):
        res = evaluate_cache(drafter_dir=drafter_dir, cache_dir=cache_dir, model=model_path, cfg=cfg,
                             progress=not as_json)
    click.echo(json.dumps(res.to_json(), indent=2) if as_json else format_result(res))
