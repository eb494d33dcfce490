"""Every error dflash raises on purpose. The CLI turns DflashError into a clean message and exit 1;
anything else is a bug and keeps its traceback."""


class DflashError(Exception):
    """Base class: a user, data or environment problem with a message that says what to do."""


class ConfigError(DflashError, ValueError):
    """A configuration value is invalid; the message names the field, the value and the fix."""


class CacheFormatError(DflashError):
    """A cache on disk is malformed, corrupted (checksum mismatch) or of an unknown format version."""


class CacheMismatchError(DflashError):
    """Two objects that must belong together disagree on one field: a cache and the run that extends or reads
    it, a cache and the target model, a drafter and its target. The message names both objects and the field:
    "the drafter's num_target_layers 6 != the target's 8"; hashes are shortened to 12 hex digits and of two
    source lists only the first differing entry is shown."""

    def __init__(self, field: str, expected: object, found: object, hint: str = "", *,
                 mine: str = "the requested", theirs: str = "the cache's") -> None:
        self.field, self.expected, self.found, self.hint = field, expected, found, hint
        self.mine, self.theirs = mine, theirs
        exp, fnd = describe_difference(expected, found)
        msg = f"{mine} {field} {exp} != {theirs} {fnd}"
        super().__init__(msg + (f". {hint}" if hint else ""))

    def __reduce__(self):
        # default exception pickling calls cls(*args) with the message only; a spawned process reports it
        return (_rebuild_mismatch, (self.field, self.expected, self.found, self.hint, self.mine, self.theirs))


def _rebuild_mismatch(field, expected, found, hint, mine, theirs) -> CacheMismatchError:
    return CacheMismatchError(field, expected, found, hint, mine=mine, theirs=theirs)


HASH_SHOWN = 12   # hex digits of a sha256 shown in messages (git's short hashes are 7-12)


def _short(value: object) -> str:
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:HASH_SHOWN]
    if isinstance(value, dict) and "path" in value:
        extra = {k: _short(v) for k, v in value.items() if k != "path"}
        return repr(value["path"]) + (f" ({', '.join(f'{k} {v}' for k, v in extra.items())})" if extra else "")
    return repr(value)


def describe_difference(expected: object, found: object) -> tuple[str, str]:
    """Short texts of two differing values: hashes cut to HASH_SHOWN digits; of two lists only the first
    differing entry with its index (a source list names the differing path, not every source)."""
    if isinstance(expected, (list, tuple)) and isinstance(found, (list, tuple)):
        for i, (a, b) in enumerate(zip(expected, found)):
            if a != b:
                return f"[{i}] {_short(a)}", f"[{i}] {_short(b)}"
        n = min(len(expected), len(found))
        more = [f"{len(x)} entries" + (f" (first extra [{n}] {_short(x[n])})" if len(x) > n else "")
                for x in (expected, found)]
        return more[0], more[1]
    return _short(expected), _short(found)


class CacheNotFoundError(DflashError, FileNotFoundError):
    """No cache (manifest.json) at the given path."""


class DataError(DflashError):
    """Input data cannot be used at all (missing file, unknown format); per-record problems are skipped, not raised."""


class ModelNotFoundError(DflashError, FileNotFoundError):
    """A model path or checkpoint does not exist or is not a model."""


class OutOfSpaceError(DflashError, OSError):
    """The destination has no room: raised before work starts, or when a write fails with ENOSPC."""


class LockedError(DflashError):
    """A folder (cache, training run) is locked by another live process; the message names its PID and host."""


class StoreError(DflashError):
    """An object store (s3://...) cannot be used: unreachable endpoint, rejected credentials, missing bucket,
    a URL scheme without its client; the message is one line naming the URL and what to fix."""


class TrainingDiverged(DflashError):
    """A training step's gradient norm was not finite (a nan/inf loss or an overflow): the run stops before the
    diverged weights are evaluated, checkpointed or exported; the message names the step and the newest checkpoint."""


def in_chain(e: BaseException | None, match) -> BaseException | None:
    """The first exception of e's chain (e, then each __cause__, or __context__ unless `raise ... from None` hid
    it) for which match(x) holds, else None. A library reports its own failure while another propagates:
    torch.save's zip writer, cut by Ctrl-C, raises RuntimeError("unexpected pos") from its __exit__ with the
    KeyboardInterrupt as its context."""
    seen = set()
    while e is not None and id(e) not in seen:
        if match(e):
            return e
        seen.add(id(e))
        e = e.__cause__ if e.__cause__ is not None else None if e.__suppress_context__ else e.__context__
    return None


def interrupt_in_chain(e: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt behind e (e itself included), if any."""
    return in_chain(e, lambda x: isinstance(x, KeyboardInterrupt))
