"""File formats -> raw records. Each reader yields `(location, obj)` for every record, or a `Skip` for a
record that cannot be parsed; only a missing path or an unknown format raises (DataError, before any work).

Formats: .jsonl (one object a line), .json (a list of objects, streamed record by record so a 100+ MB file
is never parsed as one document and a truncated tail - the ShareGPT V3 file ends mid-record - stops
cleanly), .parquet (pyarrow), and HF `datasets` save_to_disk folders (arrow IPC streams read with pyarrow
directly: `datasets` is not a dependency). A `.gz` suffix on .jsonl/.json is read through gzip.
"""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import pathlib
import re
import zlib
from collections.abc import Iterator
from typing import Any

from dflash.data.skips import BAD_JSON, TRUNCATED_FILE, Skip
from dflash.errors import DataError

log = logging.getLogger(__name__)

RawItem = tuple[str, Any] | Skip

# 1 MiB: large enough that the retry of a record cut by a chunk boundary costs little (records are ~7 KB).
_CHUNK_CHARS = 1 << 20
_SEPARATOR = re.compile(r"[\s,]*")
_ROW_BATCH = 1024


def detect_format(path: pathlib.Path) -> str:
    """'jsonl' | 'json' | 'parquet' | 'arrow_dir'; raises DataError for a missing path or an unknown format."""
    if not path.exists():
        raise DataError(f"data path {str(path)!r} does not exist")
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            return "arrow_dir"
        raise DataError(
            f"data folder {str(path)!r} is not a datasets save_to_disk folder (no state.json or "
            "dataset_dict.json); pass the .jsonl/.json/.parquet files themselves"
        )
    if _is_gz(path):
        with open(path, "rb") as f:
            magic = f.read(2)
        if magic != b"\x1f\x8b":
            raise DataError(f"data file {str(path)!r} is named .gz but is not gzip-compressed (it starts with "
                            f"{magic!r}): rename it without .gz, or compress it")
    name = path.name.lower().removesuffix(".gz")
    for suffix, fmt in ((".jsonl", "jsonl"), (".json", "json"), (".parquet", "parquet")):
        if name.endswith(suffix) and not (fmt == "parquet" and path.name.lower().endswith(".gz")):
            return fmt
    raise DataError(
        f"unknown data file format {path.name!r}: use .jsonl, .json, .parquet or a datasets save_to_disk folder"
    )


def iter_raw(path: str | pathlib.Path) -> Iterator[RawItem]:
    """Every record of one data path in file order. Call `detect_format` first to fail before any work."""
    path = pathlib.Path(path)
    fmt = detect_format(path)
    if fmt == "jsonl":
        yield from _iter_jsonl(path)
    elif fmt == "json":
        yield from _iter_json_list(path)
    elif fmt == "parquet":
        yield from _iter_parquet(path)
    else:
        yield from _iter_arrow_dir(path)


def _is_gz(path: pathlib.Path) -> bool:
    return path.name.lower().endswith(".gz")


class _Text:
    """A data file as text: UTF-8 with a leading BOM accepted (editors on Windows write one), invalid bytes
    replaced by U+FFFD and counted (reported once per file, not silently), and a .gz read through gzip with a
    corrupt or truncated stream turned into one DataError naming the file."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.raw = gzip.open(path, "rb") if _is_gz(path) else open(path, "rb")
        self.replaced = 0
        self.first_bad = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._start = True

    def __enter__(self) -> _Text:
        return self

    def __exit__(self, *exc) -> None:
        self.raw.close()

    def _decode(self, raw: bytes, *, final: bool, where: str) -> str:
        text = self._decoder.decode(raw, final=final)
        if self._start and text:
            text, self._start = text.removeprefix("\ufeff"), False
        bad = text.count("\ufffd") - raw.count(b"\xef\xbf\xbd")  # minus U+FFFD written in the file itself
        if bad > 0:
            self.replaced += bad
            self.first_bad = self.first_bad or where
        return text

    def _guard(self, read):
        try:
            return read()
        except (EOFError, OSError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
            if not _is_gz(self.path):
                raise
            raise DataError(f"{self.path}: the gzip stream is corrupt or truncated ({e}); re-download or "
                            "re-compress the file") from e

    def lines(self) -> Iterator[tuple[int, str]]:
        line_no = 0
        while line := self._guard(self.raw.readline):
            line_no += 1
            yield line_no, self._decode(line, final=False, where=f"line {line_no}")

    def read(self, size: int = -1) -> str:
        raw = self._guard(lambda: self.raw.read(size))
        return self._decode(raw, final=not raw or size < 0, where="a record")

    def report(self) -> None:
        """Log the replaced bytes once the whole file was read."""
        if self.replaced:
            log.warning("%s: %d invalid UTF-8 byte sequence(s) replaced by U+FFFD (first at %s)", self.path,
                        self.replaced, self.first_bad)


def _iter_jsonl(path: pathlib.Path) -> Iterator[RawItem]:
    with _Text(path) as f:
        for line_no, line in f.lines():
            if not line.strip():
                continue  # blank lines are not records
            location = f"{path}:{line_no}"
            try:
                yield location, json.loads(line)
            except json.JSONDecodeError as e:
                yield Skip(BAD_JSON, location, f"{e.msg} at column {e.colno}")
        f.report()


def _iter_json_list(path: pathlib.Path) -> Iterator[RawItem]:
    """Stream a top-level JSON list element by element with raw_decode; a top-level object is one record."""
    decoder = json.JSONDecoder()
    with _Text(path) as f:
        yield from _json_list_items(path, f, decoder)
        f.report()


def _json_list_items(path: pathlib.Path, f: _Text, decoder: json.JSONDecoder) -> Iterator[RawItem]:
    buf, eof = f.read(_CHUNK_CHARS), False
    pos = _SEPARATOR.match(buf).end()
    line_no = 1 + buf.count("\n", 0, pos)
    if not buf[pos:pos + 1] == "[":
        text = buf + f.read()
        try:
            yield f"{path}:{line_no}", json.loads(text)
        except json.JSONDecodeError as e:
            yield Skip(BAD_JSON, f"{path}:{e.lineno}", e.msg)
        return
    pos += 1
    while True:
        end_sep = _SEPARATOR.match(buf, pos).end()
        line_no += buf.count("\n", pos, end_sep)
        pos = end_sep
        if pos == len(buf) and not eof:
            buf, pos = buf[pos:] + f.read(_CHUNK_CHARS), 0
            eof = pos == len(buf)
            continue
        if buf[pos:pos + 1] == "]":
            return
        if pos == len(buf):  # eof without the closing bracket, between records
            yield Skip(TRUNCATED_FILE, f"{path}:{line_no}", "file ends before the closing ']'")
            return
        try:
            obj, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as e:
            # A record cut by the end of the buffer fails at (or, for a string, opens a string that runs to)
            # the end of the buffer; an error earlier than that is malformed JSON.
            cut = e.msg.startswith("Unterminated string") or e.pos >= len(buf) - 16
            if cut and not eof:
                more = f.read(_CHUNK_CHARS)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            # A list cannot be resynchronised after an error, so both cases stop this file.
            reason = TRUNCATED_FILE if cut else BAD_JSON
            yield Skip(reason, f"{path}:{line_no}", f"{e.msg}; the rest of the file is ignored")
            return
        yield f"{path}:{line_no}", obj
        line_no += buf.count("\n", pos, end)
        pos = end


def _iter_table_rows(batches, location_prefix: str) -> Iterator[RawItem]:
    row = 0
    for batch in batches:
        for obj in batch.to_pylist():
            yield f"{location_prefix}:row {row}", obj
            row += 1


def _iter_parquet(path: pathlib.Path) -> Iterator[RawItem]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a file that is not parquet
        raise DataError(f"cannot read parquet file {str(path)!r}: {e}") from e
    yield from _iter_table_rows(pf.iter_batches(batch_size=_ROW_BATCH), str(path))


def _arrow_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """The data files of a save_to_disk folder in order (a DatasetDict lists its splits in dataset_dict.json)."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        return [f for split in splits for f in _arrow_files(folder / split)]
    state_path = folder / "state.json"
    if state_path.is_file():
        state = json.loads(state_path.read_text())
        names = [d["filename"] for d in state.get("_data_files", [])]
        if names:
            return [folder / n for n in names]
    return sorted(folder.glob("data-*.arrow"))


def _iter_arrow_dir(folder: pathlib.Path) -> Iterator[RawItem]:
    import pyarrow as pa

    files = _arrow_files(folder)
    if not files:
        raise DataError(f"datasets folder {str(folder)!r} has no data-*.arrow files")
    for f in files:
        if not f.is_file():
            raise DataError(f"datasets folder {str(folder)!r} lists {f.name!r}, which does not exist")
        try:
            reader = pa.ipc.open_stream(pa.memory_map(str(f)))  # datasets writes the IPC stream format
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(pa.memory_map(str(f)))
            yield from _iter_table_rows((reader.get_batch(i) for i in range(reader.num_record_batches)), str(f))
            continue
        yield from _iter_table_rows(reader, str(f))
