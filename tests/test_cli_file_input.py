"""Input files at the command line are checked fully before a run is registered, and streamed:
the play receives a read-only sequence backed by the file, which `run.map` stages page by page
like a list of the same rows (same fingerprint and pages), in bounded memory."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys

import pytest

from runplane.actors import open_run
from runplane.cli.inputs import MAX_RECORD_BYTES, FileRows, LongRecordError, read_input
from runplane.engine.errors import InvalidInputError

from .cli_helpers import cli_env, run_cli, schema  # noqa: F401 - fixture
from .sheet_helpers import CONTRACT

MEMORY_PLAY = '''

from runplane.engine.sheets import SheetContract

PLAY = "big"
CONTRACT = SheetContract(inputs=("name", "city"), outputs=("size",))


async def measure(row):
    return {"size": len(row["name"])}


async def play(run, rows):
    print(f"rows: {type(rows).__name__}, list: {isinstance(rows, list)}, len: {len(rows)}, "
          f"first: {rows[0]['name']}, last: {rows[-1]['name']}", flush=True)
    result = await run.map("things", rows, measure, contract=CONTRACT, concurrency=8)
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a CLI started from a big
    # pytest process would report the parent's size.
    with open("/proc/self/status") as status:
        peak_kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    print(f"peak RSS MB: {peak_kb / 1024:.0f}", flush=True)
    return result
'''


LIMIT_NOTE = r"\(a row holds at most 1,048,576 bytes, the page limit\)"


def write_memory_play(tmp_path):
    play = tmp_path / "big_play.py"
    play.write_text(MEMORY_PLAY)
    return play


def test_a_bad_file_is_one_line_and_registers_no_run(schema, tmp_path):  # noqa: F811
    play = write_memory_play(tmp_path)
    good = "".join(f'{{"name": "n{i}", "city": "Oslo"}}\n' for i in range(3000))
    cases = [
        ("huge_row.jsonl", good + '{"name": "big", "city": "' + "x" * (1 << 20) + '"}\n',
         r"huge_row\.jsonl:3001: the row alone needs \d+ bytes of canonical JSON; a page fact "
         r"holds at most 1048576 bytes"),
        ("broken.jsonl", good + '{"name": "late", \n',
         r"broken\.jsonl:3001: invalid JSON at column 18: Expecting property name enclosed in "
         r"double quotes"),
        ("wide.csv", "name,city\n" + "a,b\n" * 3000 + "c,d,e\n",
         r"wide\.csv:3002: 3 cells, but the header has 2 columns"),
        # A line or a CSV record past the text a row may hold (one cell, or quoted cells
        # spanning lines), refused by the bound on what is read, not by the page limit.
        ("long_line.jsonl", good + '{"name": "x", "city": "' + "y" * (3 << 20) + '"}\n',
         r"long_line\.jsonl:3001: the line is longer than 1,081,344 bytes " + LIMIT_NOTE),
        ("long_line.csv", "name,city\n" + "a,b\n" * 3000 + "y" * (3 << 20) + ",Oslo\n",
         r"long_line\.csv:3002: the record is longer than 1,081,344 bytes " + LIMIT_NOTE),
        ("long_record.csv", "name,city\n" + "a,b\n" * 3000 + ",".join(
            ['"' + "y\n" * 300_000 + '"'] * 2) + "\n",
         r"long_record\.csv:3002: the record is longer than 1,081,344 bytes " + LIMIT_NOTE),
    ]
    for name, content, message in cases:
        path = tmp_path / name
        path.write_text(content)
        done = run_cli("run", str(play), "--input", str(path), "--schema", schema)
        assert done.returncode == 2, (name, done.stdout, done.stderr)
        assert done.stdout == "", name
        assert re.fullmatch(f"runplane: {re.escape(str(tmp_path))}/{message}\n", done.stderr), (
            name, done.stderr[:300])
    # Nothing connected, so no run was registered (the schema does not even exist).
    listed = run_cli("runs", "big", "--schema", schema)
    assert listed.returncode == 1 and "has no runplane tables" in listed.stderr


def test_a_large_csv_is_mapped_from_the_file_in_bounded_memory(schema, tmp_path):  # noqa: F811
    rows = 200_000
    play = write_memory_play(tmp_path)
    path = tmp_path / "big.csv"
    with path.open("w") as out:
        out.write("name,city\n")
        out.writelines(f"company-{i},Oslo\n" for i in range(rows))
    done = run_cli("run", str(play), "--input", str(path), "--schema", schema,
                   env=cli_env(), timeout=600)
    assert done.returncode == 0, done.stderr
    print(done.stdout)
    assert (f"rows: FileRows, list: False, len: {rows}, first: company-0, "
            f"last: company-{rows - 1}") in done.stdout
    assert f"admitted {rows}, cached 0, completed {rows}, failed 0" in done.stdout
    peak = int(re.search(r"peak RSS MB: (\d+)", done.stdout).group(1))
    print(f"peak RSS of the CLI mapping {rows:,} CSV rows: {peak} MB")
    assert peak < 200  # a generous bound: the rows are never all in memory


def rows_with_large_cells(path, count: int) -> list[str]:
    """A CSV whose pages are cut by bytes as well as by rows; returns the names."""
    names = [f"n{i}" + ("x" * 300_000 if i % 200 == 7 else "") for i in range(count)]
    path.write_text("name\n" + "".join(f"{name}\n" for name in names))
    return names


async def test_a_file_and_the_list_of_its_rows_are_one_staged_input(tenant, tmp_path):
    """A run staged from the file is woken with the list of the same rows (and the reverse
    holds by the same shape): the staged input is the same, so nothing runs again."""
    names = rows_with_large_cells(tmp_path / "rows.csv", 2500)
    rows = read_input(str(tmp_path / "rows.csv")).rows
    assert isinstance(rows, FileRows) and len(rows) == 2500
    calls: list[str] = []

    async def fn(row):
        calls.append(row["name"])
        return {"score": len(row["name"])}

    async with open_run(tenant, "files", retire_on_exit=False) as run:
        first = await run.map("t", rows, fn, contract=CONTRACT)
    assert first.completed == 2500 and sorted(calls) == sorted(names)
    calls.clear()
    async with open_run(tenant, "files", run.run_id) as woken:
        again = await woken.map("t", list(rows), fn, contract=CONTRACT)
    assert (again.cached, again.completed, calls) == (2500, 0, [])


def test_a_file_changed_after_its_check_is_refused(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("name\n" + "".join(f"n{i}\n" for i in range(1200)))
    rows = read_input(str(path)).rows
    assert rows[1199] == {"name": "n1199"}
    path.write_text("name\n" + "".join(f"m{i}\n" for i in range(1200)))
    with pytest.raises(InvalidInputError, match="changed after it was checked"):
        rows[600]


def test_file_rows_read_back_exactly_the_rows_of_the_file(tmp_path):
    """Across index blocks (by rows and by bytes), with a byte-order mark, blank lines, quoted
    newlines and short records: every way of reading gives the rows a whole-file parse gives."""
    records = [[f"n{i}", "multi\nline" if i % 97 == 3 else ("y" * 70_000 if i % 400 == 9 else "")]
               for i in range(1300)]
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["name", "note"])
    for i, record in enumerate(records):
        writer.writerow(record if i % 50 else record[:1])
        if i % 333 == 0:
            text.write("\n")
    path = tmp_path / "rows.csv"
    path.write_bytes(b"\xef\xbb\xbf" + text.getvalue().encode())
    expected = [{"name": r[0], "note": r[1] if i % 50 else None} for i, r in enumerate(records)]
    rows = read_input(str(path)).rows
    assert len(rows) == 1300 and list(rows) == expected
    assert rows[499:502] == expected[499:502] and rows[-1] == expected[-1]
    assert [rows[i] for i in (0, 500, 1000, 1299)] == [expected[i] for i in (0, 500, 1000, 1299)]

    lines = [json.dumps({"i": i, "blob": "z" * (90_000 if i % 300 == 1 else 1)}) for i in range(1100)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines[:600]) + "\n\n  \n" + "\n".join(lines[600:]))  # no final \n
    rows = read_input(str(path)).rows
    assert list(rows) == [json.loads(line) for line in lines]
    assert rows[1099] == json.loads(lines[1099])


CHECK_IN_A_CHILD = '''
import sys

from runplane.cli.inputs import InputFileError, read_input


def peak_kib() -> int:
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec (see MEMORY_PLAY).
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


before = peak_kib()
try:
    read_input(sys.argv[1])
except InputFileError as exc:
    print(f"refused: {exc}")
print(f"peak growth KiB: {peak_kib() - before}")
'''

LONG = 200 << 20  # the long record's size: 200 MiB, written in 1 MiB chunks


def write_long_input(path, kind: str) -> None:
    """A file whose second line (or CSV record) holds LONG bytes: one cell on one line, one
    JSON line, or 400 quoted cells of 512 KiB, each spanning two physical lines."""
    chunk = "y" * (1 << 20)
    with path.open("w") as out:
        if kind == "line.csv":
            out.write("name,city\n")
            out.writelines(chunk for _ in range(LONG >> 20))
            out.write(",Oslo\nlast,Oslo\n")
        elif kind == "line.jsonl":
            out.write('{"name": "first"}\n{"name": "')
            out.writelines(chunk for _ in range(LONG >> 20))
            out.write('"}\n{"name": "last"}\n')
        else:
            cells = LONG // (512 << 10)
            half = "y" * (256 << 10)
            out.write(",".join(f"c{i}" for i in range(cells)) + "\n")
            out.write(",".join(f'"{half}\n{half}"' for _ in range(cells)) + "\n")


@pytest.mark.parametrize("kind", ["line.csv", "line.jsonl", "record.csv"])
def test_a_long_line_or_record_is_refused_in_bounded_memory(tmp_path, kind):
    """§28.4: the check reads at most the cell limit + 64 KiB of a long line or record before
    it refuses it, so its peak memory does not grow with the line (before: 200 MiB of line
    came to well over 400 MiB)."""
    path = tmp_path / f"long_{kind}"
    write_long_input(path, kind)
    done = subprocess.run([sys.executable, "-c", CHECK_IN_A_CHILD, str(path)],
                          capture_output=True, text=True, timeout=120)
    path.unlink()
    assert done.returncode == 0, done.stderr
    what = "line" if kind.endswith("jsonl") else "record"
    assert f"refused: {path}:2: the {what} is longer than 1,081,344 bytes (a row holds at most " \
        "1,048,576 bytes, the page limit)\n" in done.stdout, done.stdout[:500]
    growth_kib = int(re.search(r"peak growth KiB: (\d+)", done.stdout).group(1))
    print(f"{kind}: peak growth while refusing a {LONG >> 20} MiB record: {growth_kib} KiB")
    assert growth_kib < 64 * 1024


def test_a_json_line_of_the_bound_is_read_and_one_byte_more_is_refused(tmp_path):
    """A line that fits a page once canonical (here thanks to its spaces) is read whole up to
    MAX_RECORD_BYTES with its end of line; one byte more refuses it, with the limit as a value."""
    def line_of(size: int) -> str:
        head = '{"name": "' + "n" * 1_000_000 + '", "x":'
        return head + " " * (size - len(head) - 3) + "1}\n"

    path = tmp_path / "edge.jsonl"
    path.write_text('{"name": "a"}\n' + line_of(MAX_RECORD_BYTES) + '{"name": "b"}\n')
    rows = read_input(str(path)).rows
    assert [len(row["name"]) for row in rows] == [1, 1_000_000, 1]
    path.write_text('{"name": "a"}\n' + line_of(MAX_RECORD_BYTES + 1))
    with pytest.raises(LongRecordError) as refused:
        read_input(str(path))
    assert (refused.value.path, refused.value.line, refused.value.limit) == (
        str(path), 2, MAX_RECORD_BYTES)
