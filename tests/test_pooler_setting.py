"""The pooler setting and the one-line hint, without a pooler: `engine.pg.pooler` does no I/O.
The hint's first symptom (a refused startup parameter) is met through a real PgBouncer in
`tests/test_pooler.py`; the other, a prepared statement that the next server connection does
not have (SQLSTATE 26000), is the driver's message checked here."""

from __future__ import annotations

import pytest

from runplane.engine.errors import InvalidInputError
from runplane.engine.pg.pooler import PoolerMode, pooler_hint, pooler_mode, without_pooler_param


def test_a_lost_prepared_statement_is_named_a_transaction_mode_poolers_symptom():
    hint = pooler_hint('prepared statement "__asyncpg_stmt_3__" does not exist\n')
    assert hint is not None and "RUNPLANE_POOLER=transaction" in hint
    assert 'prepared statement "__asyncpg_stmt_3__" does not exist)' in hint  # stripped
    refused = pooler_hint("unsupported startup parameter: search_path")
    assert refused is not None and "RUNPLANE_POOLER=transaction" in refused
    # other errors that merely share words get no hint
    assert pooler_hint('relation "sheet_t" does not exist') is None
    assert pooler_hint("cannot insert multiple commands into a prepared statement") is None


def test_the_dsn_parameter_wins_over_the_environment_and_a_bad_value_names_its_source(
        monkeypatch):
    monkeypatch.setenv("RUNPLANE_POOLER", "transaction")
    assert pooler_mode("postgresql://h/db") is PoolerMode.TRANSACTION
    assert pooler_mode("postgresql://h/db?pooler=session") is PoolerMode.NONE
    assert pooler_mode("host=h dbname=db") is PoolerMode.TRANSACTION  # key=value: no parameter
    monkeypatch.delenv("RUNPLANE_POOLER")
    assert pooler_mode("postgresql://h/db") is PoolerMode.NONE
    with pytest.raises(InvalidInputError, match="the DSN's pooler parameter"):
        pooler_mode("postgresql://h/db?pooler=statement")
    monkeypatch.setenv("RUNPLANE_POOLER", "yes")
    with pytest.raises(InvalidInputError, match="RUNPLANE_POOLER"):
        pooler_mode("postgresql://h/db")


def test_the_pooler_parameter_is_taken_out_of_the_dsn_and_nothing_else():
    dsn = "postgresql://u@h1:6432,h2:6432/db?pooler=transaction&target_session_attrs=read-write"
    assert without_pooler_param(dsn) == \
        "postgresql://u@h1:6432,h2:6432/db?target_session_attrs=read-write"
    assert without_pooler_param("host=h dbname=db") == "host=h dbname=db"
