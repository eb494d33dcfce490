"""`dflash cache ...`: inspect and verify a hidden-state cache."""

from __future__ import annotations

import json

import click


@click.group("cache")
def command() -> None:
    """Inspect and verify a hidden-state cache."""


@command.command("info")
@click.argument("cache", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def info(cache: str, as_json: bool) -> None:
    """Samples, tokens, loss tokens, taps, dtype, shards and bytes of CACHE."""
    from dflash.cache.verify import cache_info

    d = cache_info(cache)
    if as_json:
        click.echo(json.dumps(d))
        return
    from dflash.extract.space import format_bytes

    bpt = d["bytes_per_token"]
    rows = [("target", d["target"]), ("target_greedy", "yes" if d["target_greedy"] else "no"),
            ("samples", f"{d['samples']:,}"), ("tokens", f"{d['tokens']:,}"),
            ("loss tokens", f"{d['loss_tokens']:,}"),
            ("taps", f"{d['num_taps']} {d['tap_layer_ids']}"), ("hidden size", str(d["hidden_size"])),
            ("storage", d["storage"]), ("format", d["storage_format"]), ("shards", str(d["shards"])),
            ("bytes on disk", format_bytes(d["bytes_on_disk"])),
            ("bytes per token", ("-" if bpt is None else f"{bpt:,.1f}")
             + f" (hidden {d['hidden_bytes_per_token']:,} B/token in the format, + ids, mask, index, chunk padding)")]
    if d["being_written_by"]:
        rows.append(("being written", f"by {d['being_written_by']}: totals still grow"))
    for k, v in rows:
        click.echo(f"{k:<16}{v}")


@command.command("verify")
@click.argument("cache", type=click.Path(exists=True, file_okay=False))
def verify(cache: str) -> None:
    """Check every chunk checksum of CACHE and that manifest, commit logs and shards agree."""
    from dflash.cache.verify import verify_cache

    rep = verify_cache(cache)
    for n in rep.notes:
        click.echo(f"note: {n}")
    for p in rep.problems:
        click.echo(f"BAD: {p}", err=True)
    if not rep.ok:
        raise click.ClickException(f"{len(rep.problems)} problem(s) in {cache}; first: {rep.problems[0]}; "
                                   f"{rep.repair_hint}")
    click.echo(f"ok: {rep.shards} shards, {rep.chunks} chunks checked")
