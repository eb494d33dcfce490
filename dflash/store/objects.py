"""The object-store client: open a cache URL, and turn every client failure into one StoreError line.

Client: obstore (Rust object_store; one wheel, no Python deps, releases the GIL, parallel ranged GETs;
zarr v3's `zarr.storage.ObjectStore` wraps the same object, so plain zarr-python reads a cache on a store).
s3fs would pull aiobotocore/botocore/aiohttp and is slower here: benchmarks/bench_store_clients.py, 48 x 4 MB
objects on SeaweedFS, 16-way: GET 431 vs 111 MB/s, PUT 54 vs 38 MB/s (a second run on
a loaded machine: 386/163, 63/45). Credentials come only from the
client's standard environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION,
AWS_ENDPOINT_URL, AWS_ALLOW_HTTP for http endpoints; GOOGLE_*/AZURE_* likewise): never from the command
line, and never written to the manifest, logs or messages (messages name the URL only).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflash.errors import StoreError
from dflash.store.url import StoreURL, parse_store_url

# obstore retries 10 times over up to 180 s by default: an unreachable endpoint then takes minutes to say so.
# 3 retries within 30 s still ride out a restarting server (SeaweedFS restarts in ~5-25 s here).
# (No client_options: passing any drops the ones the client read from the environment, AWS_ALLOW_HTTP too.)
RETRY = {"max_retries": 3, "retry_timeout": datetime.timedelta(seconds=30)}


@dataclass(frozen=True, kw_only=True)
class Store:
    """An opened cache location on an object store: `keys` are relative to the URL's prefix."""

    url: StoreURL
    client: Any
    """The obstore store (prefix applied)."""

    def call(self, what: str, fn: Callable, *args, **kwargs):
        """Run one client call; every client error becomes a StoreError naming the URL and the fix."""
        try:
            return fn(self.client, *args, **kwargs)
        except FileNotFoundError:
            raise
        except Exception as e:  # obstore raises its own classes (no common import-free base); map them all
            raise store_error(self.url.url, what, e) from e

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""
        import obstore
        try:
            return bytes(self.call(f"GET {key}", obstore.get, key).bytes())
        except FileNotFoundError as e:
            check_not_missing_bucket(self.url.url, e)
            return None

    def get_to_file(self, key: str, path: str) -> int | None:
        """Stream the object into a new file at `path` (network and disk overlap: no whole-object buffer);
        returns its size, or None when it does not exist."""
        import obstore
        n = 0
        try:
            result = obstore.get(self.client, key)
            with open(path, "wb") as f:
                for chunk in result.stream(min_chunk_size=STREAM_CHUNK):
                    f.write(chunk)
                    n += len(chunk)
        except FileNotFoundError as e:
            check_not_missing_bucket(self.url.url, e)
            return None
        except OSError:
            raise  # the local file (obstore's own errors are not OSErrors, except not-found)
        except Exception as e:
            raise store_error(self.url.url, f"GET {key}", e) from e
        return n

    def get_ranges(self, key: str, *, starts: list[int], ends: list[int]) -> list[bytes]:
        import obstore
        try:
            return [bytes(b) for b in self.call(f"GET {key} ranges", obstore.get_ranges, key,
                                                starts=starts, ends=ends)]
        except FileNotFoundError as e:
            raise StoreError(f"{self.url.url}: object {key} vanished while reading it ({e.__class__.__name__})"
                             ) from e

    def get_range(self, key: str, *, start: int, end: int):
        """Bytes [start, end) of an object (fewer at its end), as obstore's zero-copy buffer (np.frombuffer
        views it without a copy: the reader checks the crc on it and copies once, into its destination)."""
        import obstore
        try:
            return self.call(f"GET {key} range", obstore.get_range, key, start=start, end=end)
        except FileNotFoundError as e:
            raise StoreError(f"{self.url.url}: object {key} vanished while reading it ({e.__class__.__name__})"
                             ) from e

    def get_tail(self, key: str, length: int) -> tuple[bytes, int] | None:
        """(the last `length` bytes, the object's size) in one request, or None when it does not exist."""
        import obstore
        try:
            result = self.call(f"GET {key} tail", obstore.get, key, options={"range": {"suffix": length}})
            return bytes(result.bytes()), int(result.meta["size"])
        except FileNotFoundError as e:
            check_not_missing_bucket(self.url.url, e)
            return None

    def size(self, key: str) -> int:
        import obstore
        try:
            return int(self.call(f"HEAD {key}", obstore.head, key)["size"])
        except FileNotFoundError as e:
            raise StoreError(f"{self.url.url}: object {key} vanished while reading it") from e

    def put(self, key: str, data, *, create: bool = False) -> bool:
        """PUT; with create=True a conditional create (If-None-Match: *) that returns False when the object
        already exists (S3, GCS and Azure support it; it is what makes a commit record first-writer-wins)."""
        import obstore
        from obstore.exceptions import AlreadyExistsError
        try:
            self.call(f"PUT {key}", obstore.put, key, data, mode="create" if create else "overwrite")
        except StoreError as e:
            if isinstance(e.__cause__, AlreadyExistsError):
                return False
            raise
        return True

    def get_tagged(self, key: str) -> tuple[bytes, str] | None:
        """(bytes, e_tag) of an object, or None when it does not exist: the version put_if needs."""
        import obstore
        try:
            result = self.call(f"GET {key}", obstore.get, key)
            return bytes(result.bytes()), str(result.meta["e_tag"])
        except FileNotFoundError as e:
            check_not_missing_bucket(self.url.url, e)
            return None

    def put_if(self, key: str, data, *, e_tag: str | None) -> str | None:
        """A conditional PUT: create (e_tag=None: If-None-Match *) or replace the version `e_tag` (If-Match);
        returns the new e_tag, or None when the object is not in the expected state (another writer won)."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError
        mode = "create" if e_tag is None else {"e_tag": e_tag}
        try:
            return str(self.call(f"PUT {key}", obstore.put, key, data, mode=mode)["e_tag"])
        except FileNotFoundError:
            return None  # replacing a version that was deleted meanwhile
        except StoreError as e:
            if isinstance(e.__cause__, (AlreadyExistsError, PreconditionError)):
                return None
            raise

    def delete(self, keys: list[str]) -> None:
        import obstore
        for i in range(0, len(keys), 1000):  # S3 DeleteObjects takes at most 1000 keys
            self.call("DELETE", obstore.delete, keys[i:i + 1000])

    def list_keys(self, prefix: str | None = None) -> list[str]:
        """Every key under the cache (or under `prefix` inside it), relative to the cache prefix."""
        return [key for key, _ in self.list_sizes(prefix)]

    def list_sizes(self, prefix: str | None = None) -> list[tuple[str, int]]:
        """(key, size in bytes) of every object under the cache (or `prefix` inside it): one LIST."""
        import obstore
        try:
            batches = self.call("LIST", lambda c: list(obstore.list(c, prefix=prefix, chunk_size=1000)))
        except FileNotFoundError as e:
            check_not_missing_bucket(self.url.url, e)
            return []
        return [(m["path"], int(m["size"])) for batch in batches for m in batch]


STREAM_CHUNK = 8 << 20  # bytes per local write while streaming a GET into a file


def store_error(url: str, what: str, err: BaseException) -> StoreError:
    """One line for a client failure, by what the user must fix (never the credentials themselves)."""
    name, text = err.__class__.__name__, str(err)
    if name in ("PermissionDeniedError", "UnauthenticatedError") or "SignatureDoesNotMatch" in text \
            or "InvalidAccessKeyId" in text:
        fix = ("the store rejected the credentials: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
               "(or your cloud's credential variables) and the bucket's permissions")
    elif "NoSuchBucket" in text:
        fix = "the bucket does not exist: create it, or fix the bucket name in the URL"
    elif "error sending request" in text or "Connection refused" in text or "dns error" in text:
        fix = ("cannot reach the store's endpoint: check AWS_ENDPOINT_URL (or the default endpoint of the "
               "URL's scheme) and that the server is up")
    elif "InvalidBucketName" in text:
        fix = "the bucket name is invalid (3-63 lowercase letters, digits, '-' or '.')"
    else:
        first = text.strip().splitlines()[0] if text.strip() else name
        fix = f"{name}: {first[:300]}"
    return StoreError(f"{url}: {what} failed: {fix}")


def check_not_missing_bucket(url: str, err: FileNotFoundError) -> None:
    """A 404 for a key is "no such object"; a 404 for the bucket is a configuration error."""
    if "NoSuchBucket" in str(err):
        raise store_error(url, "access", err) from err


def open_store(url: str) -> Store:
    """Open a cache URL with the client's standard credentials and check that the bucket answers (one LIST of
    at most one key): unreachable endpoint, rejected credentials and a missing bucket fail here, in one line."""
    loc = parse_store_url(url)
    try:
        from obstore.store import from_url
    except ImportError as e:
        raise StoreError(f"{url}: caches on object stores need the obstore client: pip install obstore") from e
    base = f"{loc.scheme}://{loc.bucket}"
    try:
        client = from_url(base + (f"/{loc.prefix}" if loc.prefix else ""), retry_config=RETRY)
    except Exception as e:  # configuration errors of the client (bad region value, missing variables, ...)
        raise store_error(url, "opening the store", e) from e
    store = Store(url=loc, client=client)
    import obstore
    try:
        store.call("LIST", lambda c: next(iter(obstore.list(c, chunk_size=1)), None))
    except FileNotFoundError as e:
        check_not_missing_bucket(url, e)
    return store


def zarr_store(url: str):
    """The zarr v3 store of a cache URL (plain zarr-python reads a cache through it:
    `zarr.open_group(zarr_store(url) , path="shards/S", mode="r")`)."""
    from zarr.storage import ObjectStore
    return ObjectStore(open_store(url).client, read_only=True)
