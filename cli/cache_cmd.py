"""`dflash cache ...`: inspect and verify a hidden-state cache."""

from __future__ import annotations

import json

import click


class CacheArg(click.ParamType):
    """A cache folder that must exist, or an object-store URL (s3://...), checked when it is opened."""

    name = "CACHE"

    def convert(self, value, param, ctx):
        from dflash.store.url import is_store_url

        if is_store_url(value):
            return value
        return click.Path(exists=True, file_okay=False).convert(value, param, ctx)


CACHE = CacheArg()

store_mirror_option = click.option(
    "--store-mirror", is_flag=True,
    help="For a cache URL (s3://...): read it through a full local copy under $DFLASH_HOME/store (fetched once, "
         "then read at disk speed) instead of ranged GETs straight from the store (the default: no local copy).")
"""train, eval and sweep: the reader_path choice of dflash.store.resolve."""

@click.group("cache")
def command() -> None:
    """Inspect and verify a hidden-state cache."""


@command.command("info")
@click.argument("cache", type=CACHE)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def info(cache: str, as_json: bool) -> None:
    """Samples, tokens, loss tokens, taps, dtype, shards and bytes of CACHE."""
    from dflash.cache.verify import cache_info
    from dflash.store.resolve import store_cache_info
    from dflash.store.url import is_store_url

    d = store_cache_info(cache) if is_store_url(cache) else cache_info(cache)  # a URL: nothing fetched
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
    for k, src in enumerate(d["sources"]):  # each data source, with its committed samples when known
        n = d["source_counts"][k]["samples"] if d.get("source_counts") else None
        rows.append((f"source {k}", src + ("" if n is None else f": {n:,} samples")))
    if d["being_written_by"]:
        rows.append(("being written", f"by {d['being_written_by']}: totals still grow"))
    for k, v in rows:
        click.echo(f"{k:<16}{v}")


@command.command("verify")
@click.argument("cache", type=CACHE)
def verify(cache: str) -> None:
    """Check every chunk checksum of CACHE, that no stored feature is nan or inf, and that manifest, commit logs
    and shards agree."""
    from dflash.cache.verify import verify_cache
    from dflash.store.resolve import store_notes, verify_store_cache
    from dflash.store.url import is_store_url

    rep = verify_store_cache(cache) if is_store_url(cache) else verify_cache(cache)
    notes, problems = store_notes(cache)  # a URL's listing: orphans, records without objects ([] locally)
    rep.notes[:0] = notes
    rep.problems += problems
    for n in rep.notes:
        click.echo(f"note: {n}")
    for p in rep.problems:
        click.echo(f"BAD: {p}", err=True)
    if not rep.ok:
        raise click.ClickException(f"{len(rep.problems)} problem(s) in {cache}; first: {rep.problems[0]}; "
                                   f"{rep.repair_hint}")
    click.echo(f"ok: {rep.shards} shards, {rep.chunks} chunks checked")
