"""Every error dflash raises on purpose. The CLI turns DflashError into a clean message and exit 1;
anything else is a bug and keeps its traceback."""


class DflashError(Exception):
    """Base class: a user, data or environment problem with a message that says what to do."""


class ConfigError(DflashError, ValueError):
    """A configuration value is invalid; the message names the field, the value and the fix."""


class CacheFormatError(DflashError):
    """A cache on disk is malformed, corrupted (checksum mismatch) or of an unknown format version."""


class CacheMismatchError(DflashError):
    """A cache was made with a different fingerprint (model, tokenizer, taps, dtype, ...) than requested."""

    def __init__(self, field: str, expected: object, found: object, hint: str = "") -> None:
        self.field, self.expected, self.found = field, expected, found
        msg = f"cache fingerprint mismatch in field {field!r}: cache has {found!r}, this run has {expected!r}"
        super().__init__(msg + (f". {hint}" if hint else ""))


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
