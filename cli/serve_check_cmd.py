"""`dflash serve-check`: a served drafter's acceptance (vLLM's counters) against `dflash eval`'s on one eval cache."""

import json

import click


@click.command("serve-check")
@click.option("--drafter", "drafter_dir", required=True, type=click.Path(file_okay=False),
              help="Drafter folder (dflash export): the one the server serves.")
@click.option("--cache", "cache_dir", default=None, type=click.Path(file_okay=False),
              help="Target-greedy eval cache (`dflash generate` + `dflash extract`): its prompts are sent, its "
                   "responses give max_tokens and the expected text.")
@click.option("--responses", multiple=True, type=click.Path(dir_okay=False),
              help="Instead of --cache: a `dflash generate` output file (greedy; repeatable); the target then runs "
                   "here to give dflash eval its features.")
@click.option("--model", "model_path", required=True, help="The target the server serves (and dflash eval reads).")
@click.option("--url", default=None,
              help="A running vLLM server serving this target with this drafter (e.g. http://127.0.0.1:8000); it "
                   "must serve nothing else during the check.")
@click.option("--vllm-python", default=None, type=click.Path(dir_okay=False),
              help="Start a vLLM server here with this python (of a vLLM install; "
                   "`python -m dflash.serve.vllm_env` builds vLLM's CPU build in a venv of its own).")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16"]),
              help="dtype of the launched server and of dflash eval; float32 gives the exact check.")
@click.option("--tolerance", default=0.0, show_default=True, type=float,
              help="0: every count and every served token must equal. > 0: mean acceptance length and per-position "
                   "rates within this (bf16 decodes other greedy text at near-ties; docs/serve.md).")
@click.option("--gpu", is_flag=True, help="The launched server runs on a GPU build (no CPU-build settings).")
@click.option("--max-model-len", default=2048, show_default=True, type=int,
              help="--max-model-len of a launched server.")
@click.option("--workdir", default=None, type=click.Path(file_okay=False),
              help="Folder for the launched server's log and caches (default: a temp folder).")
@click.option("--limit", default=None, type=int, help="Check only the first N sequences of the cache.")
@click.option("--record/--no-record", default=True, show_default=True,
              help="Write the result into DRAFTER/serve_check.json and show it in the drafter's model card "
                   "(README.md, rendered again); skipped where the folder is not writable or is a hub cache.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def command(drafter_dir, cache_dir, responses, model_path, url, vllm_python, dtype, tolerance, gpu, max_model_len,
            workdir, limit, record, as_json) -> None:
    """Send the cache's prompts greedily to vLLM serving the drafter and compare its spec-decode counters
    (drafts, accepted tokens, per position) with dflash eval's on the same responses; exit 1 when they differ.
    The result goes into the drafter folder (serve_check.json) and its model card, unless --no-record."""
    from dflash.errors import ConfigError
    from dflash.serve.check import format_check, serve_check
    from dflash.serve.server import LaunchConfig

    if (url is None) == (vllm_python is None):
        raise ConfigError("give --url of a running vLLM server or --vllm-python to start one (not both)")
    responses = list(responses) or None
    if (cache_dir is None) == (responses is None):
        raise ConfigError("give --cache (an eval cache) or --responses (a `dflash generate` file), not both")
    if tolerance < 0:
        raise ConfigError(f"--tolerance {tolerance}: must be >= 0")
    launch = None if vllm_python is None else LaunchConfig(python=vllm_python, dtype=dtype, cpu=not gpu,
                                                            max_model_len=max_model_len)
    res = serve_check(drafter_dir=drafter_dir, cache_dir=cache_dir, responses=responses, model=model_path, url=url,
                      launch=launch, workdir=workdir, tolerance=tolerance, limit=limit, eval_dtype=dtype,
                      echo=lambda m: click.echo(m, err=True))
    click.echo(json.dumps(res.to_json(), indent=2) if as_json else format_check(res))
    if record:
        from dflash.serve.record import record_check

        done = record_check(res, drafter_dir)
        if done.record is None:
            click.echo(f"not recorded: {done.why_not}", err=True)
        else:
            card = f"; model card {done.card} updated" if done.card else " (no dflash model card in the folder)"
            click.echo(f"recorded in {done.record}{card}", err=True)
    if not res.ok:
        click.get_current_context().exit(1)
