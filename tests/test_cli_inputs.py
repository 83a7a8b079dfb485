"""Input files, DSNs, read-only commands and printed text at the command line."""

from __future__ import annotations

import re

import trio

from runplane.cli import main
from runplane.engine import open_tenant

from .cli_helpers import schema, write_play  # noqa: F401 - fixture


def run_with(tmp_path, schema, name: str, content: bytes | str, *extra: str) -> int:
    play, _ = write_play(tmp_path, [])
    path = tmp_path / name
    if isinstance(content, str):
        content = content.encode("utf-8")
    path.write_bytes(content)
    return main(["run", str(play), "--input", str(path), "--schema", schema, *extra])


def test_csv_with_a_byte_order_mark_keeps_its_first_column(schema, capsys, tmp_path):
    assert run_with(tmp_path, schema, "bom.csv", b"\xef\xbb\xbfname\nalpha\nbeta\n") == 0
    assert "admitted 2, cached 0, completed 2, failed 0" in capsys.readouterr().out
    assert main(["failures", "ops", "things", "--schema", schema]) == 0
    assert capsys.readouterr().out == "no failed rows in table things of play ops\n"
    assert main(["status", "ops", "things", "--schema", schema]) == 0
    out = capsys.readouterr().out
    # `name` was read (a BOM-prefixed header would have left every row's `name` missing and
    # failed it with a KeyError).
    assert "table things: total 2, queued 0, running 0, leased 0, completed 2, failed 0" in out


def test_input_file_errors_name_the_file_and_line(schema, capsys, tmp_path):
    cases = [
        ("latin1.csv", b"name\nalpha\ncaf\xe9\n",
         "latin1.csv:3: byte 0xe9 at column 4 is not UTF-8 (save the file as UTF-8)"),
        ("huge.csv", "name\nok\n" + "x" * (1024 * 1024 + 1) + "\n",
         "huge.csv:3: a cell is larger than 1,048,576 bytes (the page limit)"),
        ("wide.csv", "name\na\nb,c\n", "wide.csv:3: 2 cells, but the header has 1 columns"),
        ("twice.csv", "name,name\na,b\n",
         "twice.csv:1: the header names column 'name' twice (columns 1 and 2)"),
        ("broken.jsonl", '{"name": "a"}\n{"name": \n',
         "broken.jsonl:2: invalid JSON at column 10: Expecting value"),
        ("list.jsonl", '{"name": "a"}\n\n[1]\n', "list.jsonl:3: each line must be a JSON object"),
        ("nan.jsonl", '{"name": "a"}\n{"name": "b", "score": NaN}\n',
         "nan.jsonl:2: field score: nan is not a JSON number"),
        ("deep.jsonl", '{"name": "a", "meta": {"odd key": [1, 2, 1e400]}}\n',
         'deep.jsonl:1: field meta["odd key"][2]: inf is not a JSON number'),
        ("notes.txt", "name\n", "notes.txt: input must be .csv or .jsonl"),
    ]
    for name, content, message in cases:
        assert run_with(tmp_path, schema, name, content) == 2, name
        captured = capsys.readouterr()
        assert captured.out == "", name
        assert captured.err == f"runplane: {tmp_path / message}\n", name


def test_a_cell_larger_than_the_csv_default_limit_is_accepted(schema, capsys, tmp_path):
    big = "b" * 300_000  # over the csv module's 131,072 default, under the page limit
    assert run_with(tmp_path, schema, "big.csv", f"name\n{big}\nc\n") == 0
    assert "admitted 2, cached 0, completed 2, failed 0" in capsys.readouterr().out


def test_empty_inputs_say_so_and_exit_0_without_a_run(schema, capsys, tmp_path):
    cases = [
        ("empty.csv", "", "empty.csv: the file is empty; nothing to run"),
        ("header.csv", "name\n", "header.csv: a header and no rows; nothing to run"),
        ("blank.jsonl", "\n  \n", "blank.jsonl: the file is empty; nothing to run"),
    ]
    for name, content, message in cases:
        assert run_with(tmp_path, schema, name, content) == 0, name
        assert capsys.readouterr().out == f"{tmp_path / message}\n", name
    # Nothing connected, so nothing was created: not even the schema.
    assert main(["runs", "ops", "--schema", schema]) == 1
    assert "has no runplane tables" in capsys.readouterr().err


def test_a_malformed_dsn_is_one_line_without_its_password(capsys):
    for command in (["doctor"], ["status", "p"], ["runs", "p"], ["failures", "p", "t"]):
        assert main([*command, "--dsn", "postgresql://u:hunter2@[::1/db"]) == 1
        captured = capsys.readouterr()
        assert captured.err == "runplane: InvalidInputError: malformed DSN: Invalid IPv6 URL\n"


def test_read_only_commands_never_create_a_schema(dsn, monkeypatch, capsys):
    monkeypatch.setenv("RUNPLANE_DSN", dsn)
    missing = "t_never_created_by_reads"
    line = (f"runplane: schema '{missing}' has no runplane tables (check --schema or "
            "RUNPLANE_SCHEMA); nothing was created\n")
    for command in (["status", "p"], ["runs", "p"], ["failures", "p", "t"]):
        assert main([*command, "--schema", missing]) == 1
        assert capsys.readouterr().err == line
    assert main(["doctor", "--schema", missing]) == 0
    assert (f"schema      {missing} absent; nothing created (the first `runplane run` or "
            "`demo` creates it)\n") in capsys.readouterr().out

    async def exists() -> bool:
        async with open_tenant("local", dsn, schema=missing, bootstrap=False) as tenant:
            async with tenant.connection("receipts") as conn:
                return await conn.fetchval(
                    "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", missing)

    assert trio.run(exists) is False


def test_user_text_reaches_the_terminal_without_control_characters(schema, capsys, tmp_path):
    play, rows = write_play(tmp_path, ["evil1", "fine"])
    assert main(["run", str(play), "--input", str(rows), "--schema", schema]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert re.search(r"^      1  boom\[2J FAKE LINE$", out, re.MULTILINE), out
    assert main(["failures", "ops", "things", "--schema", schema]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "FAKE LINE" in out
    assert not any(line.startswith("FAKE") for line in out.splitlines())
    # An org with escapes (accepted or refused, whichever the scope rules say) never reaches
    # the terminal raw: no escape, no carriage return, no forged line.
    status = main(["doctor", "--schema", schema, "--org", "\x1b[31mred\rorg\nx"])
    captured = capsys.readouterr()
    for text in (captured.out, captured.err):
        assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", text), text
    if status == 0:
        assert "org         [31mred org x\n" in captured.out, captured.out
    else:
        assert status == 1 and captured.err.count("\n") == 1, captured.err
