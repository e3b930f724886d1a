"""A data format's auxiliary files and compressed columns go through the bounded reader (issue
53, class 6): a ``datasets`` folder's ``state.json`` / ``dataset_dict.json`` and every data file
must be regular files of bounded size (a FIFO blocked the reader), and a tiny file whose
columns expand past ``arrow_bounds.MAX_TABLE_BYTES`` (ZSTD-compressed Arrow buffers, a
dictionary-encoded parquet column) is refused before anything is decompressed or a row built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_input_surfaces import deadline

from sat_cli.tasks.arrow_bounds import MAX_TABLE_BYTES
from sat_cli.tasks.datafiles import DataError
from sat_cli.tasks.sources import MAX_SIDE_BYTES, read_rows

REPO = Path(__file__).resolve().parents[1]

# 350 rows of a 900 KiB prompt: 315 MB of rows (> 256 MiB) in a file of kilobytes, written 20
# rows at a time so that writing it never holds more than 18 MB
BOMB = """
import sys, pyarrow as pa, pyarrow.parquet as pq
kind, out = sys.argv[1], sys.argv[2]
text = "x" * (900 << 10)
batch = pa.table({"question": [text] * 20, "gold": ["1"] * 20})
if kind.startswith("parquet"):  # dictionary-encoded (the default), or plain and compressed
    plain = kind == "parquet-plain"
    with pq.ParquetWriter(out, batch.schema, compression="zstd", use_dictionary=not plain) as w:
        for _ in range(18):
            w.write_table(batch)
else:
    opts = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.OSFile(out, "wb") as sink, pa.ipc.new_stream(sink, batch.schema, options=opts) as w:
        for _ in range(18):
            w.write_table(batch)
"""

READ = """
import sys, pyarrow as pa
from types import SimpleNamespace
from sat_cli.tasks.sources import read_rows
from sat_cli.tasks.datafiles import DataError
fields = SimpleNamespace(prompt="question", answer="gold", system=None, id=None)
try:
    rows = read_rows(sys.argv[1], fields)
    print("READ", len(rows))
except DataError as exc:
    print("REFUSED", exc)
print("ARROW_PEAK", pa.default_memory_pool().max_memory())
"""


def _bomb(tmp_path: Path, kind: str) -> Path:
    if kind.startswith("parquet"):
        target = tmp_path / "bomb.parquet"
        out = target
    else:
        target = tmp_path / "ds"
        target.mkdir()
        out = target / "data-00000-of-00001.arrow"
        (target / "state.json").write_text(json.dumps({"_data_files": [{"filename": out.name}]}))
    subprocess.run([sys.executable, "-c", BOMB, kind, str(out)], check=True, timeout=120)
    assert out.stat().st_size < 1 << 20  # a tiny file
    return target


@pytest.mark.parametrize("kind", ["parquet", "parquet-plain", "datasets"])
def test_a_tiny_file_whose_columns_expand_past_the_cap_is_refused_unexpanded(tmp_path, kind):
    """Read in a fresh process: refused naming the file and both sizes, and Arrow's memory pool
    never held more than a few MB (315 MB would have been decompressed, then materialised)."""
    target = _bomb(tmp_path, kind)
    r = subprocess.run(
        [sys.executable, "-c", READ, str(target)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stderr
    assert "REFUSED" in r.stdout and "not a readable" not in r.stdout, r.stdout
    assert f"more than the {MAX_TABLE_BYTES} accepted" in r.stdout
    expanded = int(r.stdout.split("expand to at least ")[1].split(" bytes")[0])
    assert MAX_TABLE_BYTES < expanded <= 360 * 901 * 1024  # declared or counted, not guessed
    peak = int(r.stdout.split("ARROW_PEAK ")[1])
    assert peak < 32 << 20, peak


def _folder(tmp_path: Path) -> Path:
    import pyarrow as pa

    d = tmp_path / "ds"
    d.mkdir()
    table = pa.table({"question": ["1+1"], "gold": ["2"]})
    with pa.OSFile(str(d / "a.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": "a.arrow"}]}))
    return d


FIELDS = dict(prompt="question", answer="gold", system=None, id=None)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("state.json fifo", r"state.json .*(FIFO|not a regular file)"),
        ("dataset_dict.json fifo", r"a DatasetDict folder \(splits \?\)"),
        ("state.json huge", f"more than the {MAX_SIDE_BYTES} allowed"),
        ("state.json deep", "nested more than 8 levels"),
        ("state.json NaN", "not valid JSON"),
        ("data file fifo", "is not a file of the folder"),
        ("parquet fifo", r"bomb.parquet: .*(FIFO|not a regular file)"),
    ],
)
def test_side_files_are_regular_bounded_files(tmp_path, case, message):
    from types import SimpleNamespace

    d = _folder(tmp_path)
    assert [r["problem"] for r in read_rows(d, SimpleNamespace(**FIELDS))] == ["1+1"]
    target = d
    if case == "state.json fifo":
        (d / "state.json").unlink()
        os.mkfifo(d / "state.json")
    elif case == "dataset_dict.json fifo":
        os.mkfifo(d / "dataset_dict.json")
    elif case == "state.json huge":
        (d / "state.json").write_text(
            json.dumps({"_data_files": [{"filename": "a.arrow"}], "pad": "x" * MAX_SIDE_BYTES})
        )
    elif case == "state.json deep":
        (d / "state.json").write_text("[" * 20 + "]" * 20)
    elif case == "state.json NaN":
        (d / "state.json").write_text('{"_data_files": [{"filename": "a.arrow"}], "x": NaN}')
    elif case == "data file fifo":
        (d / "a.arrow").unlink()
        os.mkfifo(d / "a.arrow")
    else:
        target = tmp_path / "bomb.parquet"
        os.mkfifo(target)
    with deadline(10), pytest.raises(DataError, match=message):
        read_rows(target, SimpleNamespace(**FIELDS))


def test_one_small_file_listed_many_times_is_bounded_as_a_whole(tmp_path):
    """Probe (issue 53 v5): ``state.json`` listing one 5 KB ZSTD file of 100 MB of rows six
    times; each file was bounded alone, so all six (600 MB in Arrow's pool) were read before the
    folder's total was refused (a 1 MiB ``state.json`` can list it thousands of times). Now the
    file that would take the folder past the cap is refused before it is decompressed."""
    d = tmp_path / "ds"
    d.mkdir()
    make = (
        "import sys, pyarrow as pa\n"
        "t = pa.table({'question': ['x' * (1 << 20)] * 100, 'gold': ['1'] * 100})\n"
        "opts = pa.ipc.IpcWriteOptions(compression='zstd')\n"
        "with pa.OSFile(sys.argv[1], 'wb') as f, pa.ipc.new_stream(f, t.schema, options=opts) as w:\n"
        "    w.write_table(t)\n"
    )
    subprocess.run([sys.executable, "-c", make, str(d / "a.arrow")], check=True, timeout=120)
    assert (d / "a.arrow").stat().st_size < 64 << 10
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": "a.arrow"}] * 6}))
    r = subprocess.run(
        [sys.executable, "-c", READ, str(d)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stderr
    assert f"REFUSED {d / 'a.arrow'} (with the files listed before it)" in r.stdout, r.stdout
    peak = int(r.stdout.split("ARROW_PEAK ")[1])
    assert peak < MAX_TABLE_BYTES, peak  # the two files below the cap, not six
