"""The bounded reader's rules for the columnar data formats (issue 53, class 6).

A parquet file or an Arrow IPC stream (a ``datasets`` folder's data files) can hold a few
kilobytes that expand to gigabytes: a compressed column (ZSTD/LZ4 of a repeated value) or a
dictionary-encoded one (one long string referenced by every row). The rows' own bound
(``sources.MAX_ROW_BYTES``) applies only once a row is materialised, too late. So:

* each file is opened with :func:`sat_cli.util.fsio.open_regular` (a FIFO, a device or a folder
  is refused, never read) and must be at most :data:`MAX_FILE_BYTES` on disk;
* the **expanded size** is bounded by :data:`MAX_TABLE_BYTES` **before anything is
  decompressed**: for parquet, the sum of every column chunk's ``total_uncompressed_size`` in
  the footer (the footer itself at most :data:`MAX_FOOTER_BYTES`); for an Arrow stream, the
  uncompressed length each compressed buffer declares (read from the record batches' metadata,
  :func:`stream_expanded_bytes`, the bodies left compressed);
* the table is then read keeping dictionary-encoded text columns as dictionaries, and its size
  **as rows** (every dictionary reference counted with the length of the value it names,
  :func:`expanded_nbytes`) bounded again before the first row is materialised.

Every refusal is a :class:`~sat_cli.tasks.datafiles.DataError` naming the file and both sizes.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from sat_cli.tasks.datafiles import DataError

MAX_TABLE_BYTES = 256 << 20  # the rows of a prompt set, expanded (a math set of 500 000 rows)
MAX_FILE_BYTES = MAX_TABLE_BYTES  # a file larger on disk than its rows may be expanded
MAX_FOOTER_BYTES = 16 << 20  # a parquet file's metadata


def _too_big(what: str, size: int) -> DataError:
    return DataError(
        f"{what}: its rows expand to at least {size} bytes, more than the {MAX_TABLE_BYTES} accepted "
        "(a compressed or dictionary-encoded column; split the data)"
    )


def open_data_file(path: Path):
    """``path`` opened as a regular file of at most :data:`MAX_FILE_BYTES`; ``DataError``."""
    from sat_cli.util.fsio import NotRegularFile, open_regular

    try:
        fh = open_regular(path)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except NotRegularFile as exc:
        raise DataError(f"{path}: {exc.strerror}") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    size = os.fstat(fh.fileno()).st_size
    if size > MAX_FILE_BYTES:
        fh.close()
        raise DataError(f"{path}: {size} bytes, more than the {MAX_FILE_BYTES} accepted")
    return fh


# ---------------------------------------------------------------- Arrow IPC stream metadata
def _u32(b: bytes, p: int) -> int:
    return struct.unpack_from("<I", b, p)[0]


def _field(b: bytes, table: int, index: int) -> int | None:
    """The position of field ``index`` of the flatbuffer table at ``table`` (None: absent)."""
    vtable = table - struct.unpack_from("<i", b, table)[0]
    entry = 4 + 2 * index
    if entry >= struct.unpack_from("<H", b, vtable)[0]:
        return None
    offset = struct.unpack_from("<H", b, vtable + entry)[0]
    return table + offset if offset else None


def _deref(b: bytes, pos: int) -> int:
    return pos + _u32(b, pos)


def _batch_expanded(meta: bytes, body: bytes) -> int:
    """The bytes a record or dictionary batch's buffers take once decompressed (Arrow's
    ``Message.fbs``: Message.header_type 3 = RecordBatch, 2 = DictionaryBatch whose field 1 is
    its RecordBatch; RecordBatch field 2 = buffers (offset, length), field 3 = compression).
    A compressed buffer starts with its uncompressed length (int64; -1: stored as is)."""
    root = _deref(meta, 0)
    kind_at, header_at = _field(meta, root, 1), _field(meta, root, 2)
    kind = meta[kind_at] if kind_at is not None else 0
    if kind not in (2, 3) or header_at is None:
        return 0
    batch = _deref(meta, header_at)
    if kind == 2:
        data_at = _field(meta, batch, 1)
        if data_at is None:
            return 0
        batch = _deref(meta, data_at)
    buffers_at = _field(meta, batch, 2)
    if buffers_at is None:
        return 0
    compressed = _field(meta, batch, 3) is not None
    vector = _deref(meta, buffers_at)
    total = 0
    for k in range(_u32(meta, vector)):
        offset, length = struct.unpack_from("<qq", meta, vector + 4 + 16 * k)
        if offset < 0 or length < 0 or offset + length > len(body):
            raise ValueError(f"a buffer ({offset}, {length}) outside the batch's body")
        if compressed and length >= 8:
            declared = struct.unpack_from("<q", body, offset)[0]
            total += length - 8 if declared == -1 else declared
        else:
            total += length
    return total


def stream_expanded_bytes(source) -> int:
    """The decompressed size of every batch of the Arrow IPC stream ``source`` (read from the
    messages' metadata; no body is decompressed)."""
    import pyarrow as pa

    total = 0
    for message in pa.ipc.MessageReader.open_stream(source):
        body = message.body
        total += _batch_expanded(
            message.metadata.to_pybytes(), body.to_pybytes() if body is not None else b""
        )
        if total > MAX_TABLE_BYTES:
            break
    return total


# ---------------------------------------------------------------- tables
def expanded_nbytes(table) -> int:
    """The bytes of ``table``'s rows once materialised: a dictionary column counts, for every
    row, the length of the value it references (plus an 8-byte reference)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    total = 0
    for column in table.columns:
        for chunk in column.chunks:
            if pa.types.is_dictionary(chunk.type):
                values = chunk.dictionary
                if pa.types.is_string(values.type) or pa.types.is_binary(values.type):
                    lengths = pc.binary_length(values)
                else:  # a dictionary of other values: each as large as the largest
                    lengths = pa.array([values.nbytes // max(len(values), 1)] * len(values))
                used = pc.sum(lengths.take(chunk.indices.fill_null(0))).as_py() or 0
                total += used + 8 * len(chunk)
            else:
                total += chunk.nbytes
    return total


def check_table(table, what: str):
    """``table`` if its rows' expanded size is within :data:`MAX_TABLE_BYTES`."""
    size = expanded_nbytes(table)
    if size > MAX_TABLE_BYTES:
        raise _too_big(what, size)
    return table


def parquet_table(path: Path):
    """The table of a parquet file, bounded (module docstring)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open_data_file(path) as fh:
        try:
            pf = pq.ParquetFile(fh)
            meta = pf.metadata
            if meta.serialized_size > MAX_FOOTER_BYTES:
                raise DataError(
                    f"{path}: its metadata is {meta.serialized_size} bytes, more than the "
                    f"{MAX_FOOTER_BYTES} accepted"
                )
            declared = sum(
                meta.row_group(i).column(j).total_uncompressed_size
                for i in range(meta.num_row_groups)
                for j in range(meta.num_columns)
            )
            if declared > MAX_TABLE_BYTES:
                raise _too_big(str(path), declared)
            text = [
                f.name
                for f in pf.schema_arrow
                if pa.types.is_string(f.type)
                or pa.types.is_large_string(f.type)
                or pa.types.is_binary(f.type)
            ]
            fh.seek(0)
            table = pq.ParquetFile(fh, read_dictionary=text).read()
        except DataError:
            raise
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise DataError(f"{path}: not a readable parquet file ({str(exc)[:200]})") from None
    return check_table(table, str(path))


def ipc_stream_table(path: Path, before: int = 0):
    """The table of one Arrow IPC stream file of a ``datasets`` folder, bounded; ``before``: the
    rows the folder's earlier files already hold (a ``state.json`` may list one small file that
    expands to 256 MiB many times: each was bounded alone, all were read before the total was)."""
    import pyarrow as pa

    with open_data_file(path) as fh:
        try:
            source = pa.PythonFile(fh, mode="r")
            declared = stream_expanded_bytes(source)
            if before + declared > MAX_TABLE_BYTES:
                where = f"{path} (with the files listed before it)" if before else str(path)
                raise _too_big(where, before + declared)
            source.seek(0)
            table = pa.ipc.open_stream(source).read_all()
        except DataError:
            raise
        except (pa.ArrowException, OSError, ValueError, struct.error, IndexError) as exc:
            raise DataError(f"{path}: not a readable Arrow stream ({str(exc)[:200]})") from None
    return check_table(table, str(path))
