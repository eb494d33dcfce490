"""`dflash generate`: the target regenerates conversations (or answers prompt files), for `dflash extract`."""

import click


@click.command("generate")
@click.option("--model", "model_path", default=None,
              help="Target model (local HF folder); in-process generation. With --endpoint: optional, recorded only.")
@click.option("--data", "data", multiple=True, type=click.Path(),
              help="Conversation data (ShareGPT/OpenAI jsonl, json, parquet, arrow); repeatable. Default --turns all.")
@click.option("--prompts", "prompts_path", default=None, type=click.Path(dir_okay=False),
              help="Prompt file: jsonl(.gz) with `messages`, `conversations`, MT-Bench `turns` or `prompt` per line. "
                   "Default --turns first.")
@click.option("--output", "output_path", required=True, type=click.Path(dir_okay=False),
              help="Output .jsonl or .jsonl.gz (OUTPUT.parts holds the committed shards until the end).")
@click.option("--turns", type=click.Choice(["all", "first", "last"]), default=None,
              help="Which assistant turns to regenerate: all (each conditioned on the regenerated earlier ones), "
                   "the first, or the last.")
@click.option("--max-new-tokens", default=512, show_default=True, type=int, help="Most tokens per response.")
@click.option("--max-length", default=4096, show_default=True, type=int,
              help="Most tokens of a regenerated conversation; later turns that do not fit are dropped.")
@click.option("--batch-size", default=64, show_default=True, type=int,
              help="Prompts per decode batch (continuous: most sequences per forward step).")
@click.option("--chunk-conversations", default=1024, show_default=True, type=int,
              help="Conversations per committed shard (the unit a rerun resumes from).")
@click.option("--backend", type=click.Choice(["auto", "eager", "static", "continuous"]), default="auto",
              show_default=True,
              help="eager: HF generate; static: compiled static-cache decode in length-sorted batches, round by "
                   "round; continuous: transformers' continuous batching, one request per turn, the next turn "
                   "queued as soon as its previous one ends (for whole conversations); auto: static on CUDA, "
                   "eager elsewhere (continuous with --temperature > 0).")
@click.option("--window", default=2048, show_default=True, type=int,
              help="--backend continuous: most conversations in flight (chunks are admitted in order).")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              help="0: greedy. > 0: sample each token from softmax(logits / T), the same tokens whatever the batch "
                   "or a resume (more training text from the same prompts; records marked greedy: false, so never "
                   "an eval cache). Runs in the continuous backend's slot decoder (Llama-family targets).")
@click.option("--seed", default=0, show_default=True, type=int,
              help="With --temperature > 0: the sampling seed (another seed, other responses).")
@click.option("--no-thinking", is_flag=True, help="Render the chat template with enable_thinking=False.")
@click.option("--limit", default=None, type=int, help="Use only the first N usable conversations.")
@click.option("--device", default=None, help="cuda / cpu (default: cuda when available).")
@click.option("--dtype", default=None, type=click.Choice(["bfloat16", "float16", "float32"]),
              help="Target dtype (default: bfloat16 on GPU, float32 on CPU).")
@click.option("--stop-after", default=None, type=float,
              help="Seconds: start no chunk that would end later (for time-limited jobs); rerun to continue.")
@click.option("--endpoint", default=None, help="OpenAI-compatible server URL (e.g. http://host:8000/v1).")
@click.option("--served-model", default=None, help="With --endpoint: the model name the server serves.")
@click.option("--concurrency", default=8, show_default=True, type=int, help="With --endpoint: requests in flight.")
@click.option("--request-timeout", default=300.0, show_default=True, type=float,
              help="With --endpoint: seconds per request.")
@click.option("--retries", default=4, show_default=True, type=int,
              help="With --endpoint: retries per request (exponential backoff).")
@click.option("--max-consecutive-errors", default=8, show_default=True, type=int,
              help="With --endpoint: stop after this many failed request attempts in a row.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output of another job.")
@click.option("--keep-shards", is_flag=True,
              help="Keep OUTPUT.parts/shards/*.jsonl.gz after the merge (each readable by dflash extract --data).")
def command(model_path, data, prompts_path, output_path, turns, max_new_tokens, max_length, batch_size,
            chunk_conversations, backend, window, temperature, seed, no_thinking, limit, device, dtype, stop_after,
            endpoint, served_model, concurrency, request_timeout, retries, max_consecutive_errors, overwrite,
            keep_shards) -> None:
    """Regenerate assistant turns with the target (greedy, or sampled with --temperature), or through a served
    endpoint."""
    common = dict(data=tuple(data), prompts=prompts_path, output=output_path, turns=turns,
                  max_new_tokens=max_new_tokens, max_length=max_length, chunk_conversations=chunk_conversations,
                  template_kwargs={"enable_thinking": False} if no_thinking else {}, limit=limit, overwrite=overwrite,
                  keep_shards=keep_shards)
    from cli.interrupt import command_line, exits_on_interrupt

    def describe(_interrupt) -> str:
        from dflash.generate.output import interrupted_text
        return interrupted_text(output_path, command=command_line())

    with exits_on_interrupt(describe):
        stats = _run(common, model_path=model_path, endpoint=endpoint, served_model=served_model,
                     temperature=temperature, concurrency=concurrency, request_timeout=request_timeout,
                     retries=retries, max_consecutive_errors=max_consecutive_errors, batch_size=batch_size,
                     backend=backend, window=window, device=device, dtype=dtype, seed=seed, stop_after=stop_after)
    click.echo(stats.summary())


def _run(common: dict, *, model_path, endpoint, served_model, temperature, concurrency, request_timeout, retries,
         max_consecutive_errors, batch_size, backend, window, device, dtype, seed, stop_after):
    if endpoint is not None:
        from dflash.generate.endpoint import EndpointConfig, regenerate_endpoint

        if served_model is None:
            raise click.UsageError("--endpoint needs --served-model (the model name the server serves)")
        if temperature > 0:
            raise click.UsageError("--temperature is for in-process generation (--model); an endpoint's records "
                                   "are requested at temperature 0")
        cfg = EndpointConfig(url=endpoint, served_model=served_model, model=model_path, concurrency=concurrency,
                             request_timeout=request_timeout, retries=retries,
                             max_consecutive_errors=max_consecutive_errors, **common)
        return regenerate_endpoint(cfg, echo=click.echo, stop_after=stop_after)
    else:
        from dflash.generate.run import RegenerateConfig, regenerate

        if model_path is None:
            raise click.UsageError("--model is required (or --endpoint with --served-model)")
        cfg = RegenerateConfig(model=model_path, batch_size=batch_size, backend=backend, window=window, device=device,
                               dtype=dtype, temperature=temperature, seed=seed, **common)
        return regenerate(cfg, echo=click.echo, stop_after=stop_after)
