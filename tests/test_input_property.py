"""Hostile input, generated: for any identifiers, keys, field names and values, the
API either refuses with a typed error before any query, or stores them and reads back exactly
what was written, each field in its own column of its own sheet.

Hypothesis draws from every Unicode plane, NUL, lone surrogates, strings around the byte and
character limits, names that collide after namespace normalization and fields whose first-choice
columns collide. Each example runs in an org of its own on one schema; a `DatabaseError` (input
accepted that the database then refused) fails the example, as does a refusal after a query.
"""

from __future__ import annotations

import itertools

import trio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from runplane.engine import canonical, open_tenant
from runplane.engine.errors import InvalidInputError, ScopeError
from runplane.engine.runs import register
from runplane.engine.values.scopes import PlayScope, RunScope
from runplane.engine.sheets import RowOutcome, SheetContract, admit, complete, read_rows
from runplane.simulations.ports import CountingPort

from .conftest import fresh_schema

SCHEMA = fresh_schema()
_orgs = itertools.count()

COLLIDING = ("(*+$*,+<*/-$", "-,..+*!&,.:/")  # one first-choice column for both
EDGES = [
    "", " ", "\x00", "a\x00b", "\ud800", "x\udfffy", "\x1b[31m", "a\nb", "x" * 63, "x" * 64,
    "é" * 31 + "e", "é" * 32, "😀" * 15 + "abc", "😀" * 64, "😀" * 65, "字" * 256, "字" * 257,
    "_status", "_key", "Companies", "companies", " companies ", *COLLIDING,
]
ANY_CHAR = st.characters(exclude_categories=())  # every plane, surrogates included
CLEAN_CHAR = st.characters(exclude_categories=("Cs", "Cc"))
VALID_EDGES = ["x" * 63, "😀" * 64, "字" * 256, "Companies", "companies", " companies ", *COLLIDING]


def mostly(good, bad):
    """`good` nineteen times in twenty, `bad` otherwise (so about half the examples get past
    every check and are read back)."""
    return st.integers(0, 19).flatmap(lambda i: bad if i == 0 else good)


hostile_texts = st.one_of(
    st.sampled_from(EDGES),
    st.text(ANY_CHAR, max_size=12),
    st.text(ANY_CHAR, min_size=250, max_size=262),
    st.text(st.characters(min_codepoint=0x10000), min_size=60, max_size=66),
)
texts = mostly(st.one_of(st.text(CLEAN_CHAR, min_size=1, max_size=12).filter(str.strip),
                         st.sampled_from(VALID_EDGES)), hostile_texts)
keys = mostly(
    st.one_of(st.text(CLEAN_CHAR, min_size=1, max_size=40),
              st.text(st.sampled_from("😀字é"), min_size=500, max_size=512)),
    st.one_of(hostile_texts, st.text(ANY_CHAR, min_size=1020, max_size=1030),
              st.text(st.sampled_from("😀字é"), min_size=500, max_size=1030)),
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    mostly(st.floats(allow_nan=False, allow_infinity=False), st.floats()),
    st.text(ANY_CHAR, max_size=20), hostile_texts,
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=4,
)


class Refused(Exception):
    """The API refused the input with a typed error, before any query."""


@st.composite
def examples(draw):
    fields = draw(st.lists(texts, min_size=2, max_size=4))
    n = draw(st.integers(1, 3))
    return {
        "play": draw(texts),
        "run_id": draw(texts),
        "namespaces": draw(st.lists(texts, min_size=1, max_size=2)),
        "inputs": fields[:1],
        "outputs": fields[1:],
        "keys": draw(st.lists(keys, min_size=n, max_size=n)),
        "inputs_values": draw(st.lists(values, min_size=n, max_size=n)),
        "outputs_values": draw(st.lists(st.lists(values, min_size=3, max_size=3),
                                        min_size=n, max_size=n)),
    }


async def refusing_before_queries(port: CountingPort, call):
    mark = len(port.boundaries)
    try:
        return await call()
    except (InvalidInputError, ScopeError) as exc:
        assert len(port.boundaries) == mark, f"refused after a query: {exc}"
        raise Refused from exc


async def check(dsn: str, ex: dict) -> None:
    org = f"org-{next(_orgs)}"
    async with open_tenant(org, dsn, schema=SCHEMA) as tenant:
        port = CountingPort(tenant)
        guard = lambda call: refusing_before_queries(port, call)  # noqa: E731
        try:
            async def contract_of():
                return SheetContract(inputs=ex["inputs"], outputs=ex["outputs"])

            contract = await guard(contract_of)
            run = await guard(lambda: register(port, RunScope(org, ex["play"], ex["run_id"])))
            [name_in] = contract.inputs
            expected: dict[str, dict[str, dict]] = {}
            for ns in ex["namespaces"]:
                rows = [{name_in: v} for v in ex["inputs_values"]]
                admission = await guard(lambda: admit(port, run, ns, contract, rows,
                                                      keys=ex["keys"]))
                outcomes = []
                for row, outs in zip(admission.pending, ex["outputs_values"]):
                    data = dict(zip(contract.outputs, outs))
                    outcomes.append(RowOutcome(row.key, "completed", data))
                    sheet = expected.setdefault(ns.strip().lower(), {})
                    sheet[row.key] = {name_in: row.row[name_in], **data}
                await guard(lambda: complete(port, run, ns, contract, outcomes))
            for ns in ex["namespaces"]:
                stored = {r["_key"]: r for r in await read_rows(port, PlayScope(org, run.scope.play), ns)}
                for key, fields in expected[ns.strip().lower()].items():
                    got = {f: stored[key][f] for f in fields}
                    assert got == canonical.normalize(fields), (key, got, fields)
            event("read back")
        except Refused as refused:
            event(f"refused: {type(refused.__cause__).__name__}")


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(examples())
def test_any_input_is_refused_before_a_query_or_read_back_exactly(dsn, ex):
    trio.run(check, dsn, ex)
