"""`dflash generate`: the target's greedy responses to a prompt file, as conversations for `dflash extract`."""

import click


@click.command("generate")
@click.option("--model", "model_path", required=True, help="Target model (local HF folder).")
@click.option("--prompts", "prompts_path", required=True, type=click.Path(dir_okay=False),
              help="jsonl(.gz) with `messages`, `conversations`, MT-Bench `turns` or `prompt` per line.")
@click.option("--output", "output_path", required=True, type=click.Path(dir_okay=False),
              help="Output .jsonl: one conversation per prompt, with the generated ids.")
@click.option("--max-new-tokens", default=512, show_default=True, type=int, help="Most tokens per response.")
@click.option("--batch-size", default=8, show_default=True, type=int, help="Prompts per generate() call.")
@click.option("--no-thinking", is_flag=True, help="Render the chat template with enable_thinking=False.")
@click.option("--limit", default=None, type=int, help="Use only the first N usable prompts.")
@click.option("--device", default=None, help="cuda / cpu (default: cuda when available).")
@click.option("--dtype", default=None, type=click.Choice(["bfloat16", "float16", "float32"]),
              help="Target dtype (default: bfloat16 on GPU, float32 on CPU).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output file.")
def command(model_path, prompts_path, output_path, max_new_tokens, batch_size, no_thinking, limit, device, dtype,
            overwrite) -> None:
    """Generate the target's greedy (do_sample=False) responses, stopping at eos / end of turn."""
    from dflash.eval.generate import GenerateConfig, generate_file

    cfg = GenerateConfig(max_new_tokens=max_new_tokens, batch_size=batch_size, limit=limit,
                         template_kwargs={"enable_thinking": False} if no_thinking else {})
    stats = generate_file(model_path=model_path, prompts_path=prompts_path, output_path=output_path, cfg=cfg,
                          device=device, dtype=dtype, overwrite=overwrite)
    click.echo(f"wrote {stats.prompts} responses to {output_path}: {stats.stopped_at_eos} stopped at eos, "
               f"{stats.hit_max_tokens} hit --max-new-tokens, {stats.response_tokens} response tokens; "
               f"{stats.skipped}")
