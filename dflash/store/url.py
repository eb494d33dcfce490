"""Cache locations: a local folder or an object-store URL. One rule decides which a string is."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from dflash.errors import StoreError

# what obstore's from_url understands and we have tested or documented; file:// is a local folder
SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss")


def is_store_url(path: object) -> bool:
    """True for "SCHEME://..." with a scheme other than file; local paths (and Path objects) are False."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


@dataclass(frozen=True, kw_only=True)
class StoreURL:
    """A parsed cache URL."""

    scheme: str
    """"s3", "gs", ... (one of SCHEMES)."""
    bucket: str
    """Bucket (container) name."""
    prefix: str
    """Key prefix of the cache inside the bucket, without leading or trailing "/" ("" = bucket root)."""

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")


def parse_store_url(url: str) -> StoreURL:
    """SCHEME://BUCKET[/PREFIX] -> StoreURL; StoreError for an unknown scheme or a URL without bucket."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() not in SCHEMES:
        raise StoreError(f"{url}: unknown URL scheme {scheme!r} for a cache; use a local folder or one of "
                         + ", ".join(f"{s}://" for s in SCHEMES))
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise StoreError(f"{url}: no bucket in the URL; write {scheme}://BUCKET/PREFIX")
    return StoreURL(scheme=scheme.lower(), bucket=bucket, prefix=prefix.strip("/"))


def mirror_folder(url: str, *, root: str | None = None) -> str:
    """The local folder of a URL's read-through mirror (train/eval/sweep --store-mirror): under $DFLASH_HOME
    (or ~/.cache/dflash)/store/, named by the URL's hash, so two URLs never share one and reruns find theirs."""
    from dflash.home import dflash_home
    base = root or os.path.join(dflash_home(), "store")
    tag = hashlib.sha256(parse_store_url(url).url.encode()).hexdigest()[:16]
    return os.path.join(base, tag)


def staging_folder(url: str, *, root: str | None = None) -> str:
    """The local folder where `dflash extract --output URL` writes shards before publishing them: beside the
    URL's mirror folder, never the same one. A staging folder deletes each shard once the store holds it (its
    commit line stays, so a resume skips its samples): read as a mirror, it would claim shards it lacks."""
    return mirror_folder(url, root=root) + "-staging"
