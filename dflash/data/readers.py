"""File formats -> raw records. Each reader yields `(location, obj)` for every record, or a `Skip` for a
record that cannot be parsed; only a missing path or an unknown format raises (DataError, before any work).

Formats: .jsonl (one object a line), .json (a list of objects, streamed record by record so a 100+ MB file
is never parsed as one document and a truncated tail - the ShareGPT V3 file ends mid-record - stops
cleanly), .parquet (pyarrow), and HF `datasets` save_to_disk folders (arrow IPC streams read with pyarrow
directly: `datasets` is not a dependency). A `.gz` suffix on .jsonl/.json is read through gzip.
"""

from __future__ import annotations

import gzip
import json
import pathlib
import re
from collections.abc import Iterator
from typing import Any

from dflash.data.skips import BAD_JSON, TRUNCATED_FILE, Skip
from dflash.errors import DataError

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


def _open_text(path: pathlib.Path):
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _iter_jsonl(path: pathlib.Path) -> Iterator[RawItem]:
    with _open_text(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines are not records
            location = f"{path}:{line_no}"
            try:
                yield location, json.loads(line)
            except json.JSONDecodeError as e:
                yield Skip(BAD_JSON, location, f"{e.msg} at column {e.colno}")


def _iter_json_list(path: pathlib.Path) -> Iterator[RawItem]:
    """Stream a top-level JSON list element by element with raw_decode; a top-level object is one record."""
    decoder = json.JSONDecoder()
    with _open_text(path) as f:
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
