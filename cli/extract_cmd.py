"""`dflash extract`: run the target over conversations on every GPU and write the hidden-state cache."""

from __future__ import annotations

import click


def _parse_taps(_ctx, _param, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: give comma-separated decoder-layer ids, e.g. 1,16,31,46,61") from None


@click.command("extract")
@click.option("--model", "model", required=True,
              help="Target model: a local Hugging Face folder (config.json, weights, tokenizer).")
@click.option("--data", "data", required=True, multiple=True,
              help="Conversation source (.jsonl, .json, .parquet or a datasets save_to_disk folder); repeat "
                   "for several. Sample ids follow the order given, so keep it when resuming.")
@click.option("--output", "output", required=True,
              help="Cache directory. A new or empty one is created; an existing cache is resumed (committed "
                   "samples are skipped) or, given --data it does not hold, grown: the new conversations are "
                   "added as new shards, numbered after the cache's own sources (which must still be readable). "
                   "Options left out (taps, storage, max length, thinking, dtype) take the cache's values.")
@click.option("--taps", callback=_parse_taps, default=None,
              help="Comma-separated decoder-layer ids to cache, ascending (tap k = HF hidden_states[k+1]). "
                   "Default: the 5 DFlash taps spread from layer 1 to L-3.")
@click.option("--storage", default=None, metavar="bf16|fp8|int4|FORMAT",
              help="bf16 stores the exact bf16 values; fp8 stores e4m3 with a float32 scale per token and "
                   "tap (about half the bytes); int4 stores 4-bit codes with group scales (int4-g32-e4m3-h32: "
                   "0.27x bf16, docs/CACHE_FORMAT_4BIT.md). Another 4-bit layout by name, e.g. int4-g64-bf16-h64. "
                   "[default: bf16, or an existing --output cache's]")
@click.option("--max-length", type=click.IntRange(min=1), default=None,
              help="Truncate samples to this many tokens (a sample left with no assistant token is skipped). "
                   "[default: 4096, or an existing --output cache's]")
@click.option("--gpus", "--procs", "num_procs", type=click.IntRange(min=1), default=None,
              help="Processes to run, one per GPU (default: all visible GPUs, or 1 on CPU). On CPU, N "
                   "processes share the cores via gloo. Ignored under torchrun.")
@click.option("--batch-tokens", type=click.IntRange(min=1), default=16384, show_default=True,
              help="Token budget per forward pass, padding included; must be >= --max-length. Batches hold "
                   "1-8, 10, 12, 14, 16, 20, ... samples (FLA kernels compile once per batch size).")
@click.option("--shard-tokens", type=click.IntRange(min=1), default=1 << 16, show_default=True,
              help="Tokens per committed shard: smaller loses less work on a crash, larger makes fewer files.")
@click.option("--no-thinking", is_flag=True, default=False,
              help="Render the chat template with enable_thinking=False (Qwen3-style templates).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default=None,
              help="Dtype the target runs in (default: bfloat16 on CUDA, float32 elsewhere, as every command).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="auto: one GPU per process when CUDA is available, else CPU.")
@click.option("--fla-conv/--no-fla-conv", default=True, show_default=True,
              help="On CUDA with flash-linear-attention: FLA's Triton causal conv1d for Gated-DeltaNet layers "
                   "(faster than transformers' torch fallback). Ignored on CPU.")
@click.option("--compile-elementwise", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Qwen3.5 targets: run the layers' RMSNorm, gated RMSNorm, SiLU-gating and rotary-embedding chains "
                   "torch.compile'd (one fused kernel each; float rounding only). auto: on CUDA. Other "
                   "architectures: no effect.")
@click.option("--compile-layers", type=click.Choice(["auto", "on", "off"]), default="off", show_default=True,
              help="Run each decoder layer whole under torch.compile (one graph per layer class; float rounding "
                   "only); replaces --compile-elementwise when on. auto: on CUDA. Off until timed on the 27B shape.")
@click.option("--dry-run", is_flag=True, default=False,
              help="Print samples, tokens, bytes on disk and an ETA, then stop without loading the model.")
@click.option("--repair", is_flag=True, default=False,
              help="Resume a damaged cache: check every committed shard (reads all of it), drop those that fail "
                   "and extract their samples again.")
@click.option("--no-progress", is_flag=True, default=False, help="Do not draw the progress bar.")
def command(model, data, output, taps, storage, max_length, num_procs, batch_tokens, shard_tokens, no_thinking,
            dtype, device, fla_conv, compile_elementwise, compile_layers, dry_run, repair, no_progress) -> None:
    """Run the target model over conversation data and write the hidden-state cache.

    Prints the plan (samples, tokens, bytes on disk, ETA) before any model work and refuses to start when
    the destination lacks the space. Interrupted runs resume where they stopped, with any process count.
    """
    import logging

    from dflash.extract.driver import ExtractConfig
    from dflash.extract.launch import launch

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from dflash.extract.grow import cache_settings

    # an existing cache (resume or grow): the options left out take its own settings
    own = cache_settings(output) or {}
    template_kwargs = {"enable_thinking": False} if no_thinking else own.get("template_kwargs", {})
    max_length = max_length or own.get("max_length") or 4096
    cfg = ExtractConfig(
        model=model, data=tuple(data), output=output, taps=taps or own.get("taps"),
        storage=storage or own.get("storage") or "bf16", max_length=max_length,
        batch_tokens=batch_tokens, shard_tokens=shard_tokens,
        template_kwargs=template_kwargs,
        dtype=dtype or own.get("dtype"), device=device, fla_conv=fla_conv, compile_elementwise=compile_elementwise,
        compile_layers=compile_layers, dry_run=dry_run,
        repair=repair, show_progress=not no_progress)
    from cli.interrupt import command_line, exits_on_interrupt
    from dflash.store.url import is_store_url

    def describe(_interrupt) -> str:
        if is_store_url(output):
            from dflash.store.resolve import store_interrupted_text
            return store_interrupted_text(output, command=command_line())
        from dflash.extract.driver import interrupted_text
        return interrupted_text(output, command=command_line())

    with exits_on_interrupt(describe):
        if is_store_url(output):  # s3://...: through a local staging folder, published as shards commit
            from dflash.extract.to_store import extract_to_store
            extract_to_store(cfg, num_procs=num_procs, echo=click.echo)
        else:
            launch(cfg, num_procs=num_procs, echo=click.echo)
