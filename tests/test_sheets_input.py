"""Bad input to the sheet API is refused before any query, names the row and field, and writes
nothing (a counting port proves no statement was sent)."""

from __future__ import annotations

import pytest

from runplane.engine import PlayScope
from runplane.engine.errors import InvalidInputError, ScopeError
from runplane.engine.values.scopes import RunRef, RunScope
from runplane.engine.sheets import (
    Attempt,
    CellPolicy,
    RowOutcome,
    SheetContract,
    admit,
    complete,
    ensure_sheet,
    read_rows,
    row_key,
    summary,
)
from runplane.simulations.ports import CountingPort
from tests.sheet_helpers import CONTRACT, counters_match, new_run, play_scope, raw_rows

NS = "input_checks"


@pytest.fixture
async def setup(tenant):
    run = await new_run(tenant, "play", "r1")
    admission = await admit(tenant, run, NS, CONTRACT, [{"name": "a"}])
    return tenant, run, admission.pending[0].key


BAD_ADMISSIONS = [
    ({"rows": [{"name": "ok"}, 5]}, "rows[1]"),
    ({"rows": [{"name": "ok"}, ["name", "x"]]}, "rows[1]"),
    ({"rows": [{"name": float("nan")}]}, "rows[0].name"),
    ({"rows": [{"name": b"bytes"}]}, "rows[0].name"),
    ({"rows": [{"name": {1: "int key"}}]}, "rows[0].name"),
    ({"rows": [{"name": "a"}, {"name": "b"}], "keys": ["k", 2]}, "keys[1]"),
    ({"rows": [{"name": "a"}], "keys": [""]}, "keys[0]"),
    ({"rows": [{"name": "a"}], "keys": ["k", "l"]}, "keys has 2"),
    ({"rows": [{"name": "a"}], "input_offset": -1}, "input_offset"),
    ({"rows": [{"name": "a"}], "cell_policies": {"": CellPolicy(1)}}, "field name must not be empty"),
    ({"rows": [{"name": "a"}], "cell_policies": {"score": 5}}, "cell_policies"),
    ({"rows": "not rows"}, "rows must be"),
    ({"rows": [{"name": "a"}], "texts": ['{"name":"a"}']}, "texts can only be given with keys"),
    ({"rows": [{"name": "a"}], "keys": ["k"], "texts": []}, "texts must be a sequence"),
    ({"rows": [{"name": "a"}], "keys": ["k"], "texts": [5]}, "texts[0]"),
]


@pytest.mark.parametrize(("kwargs", "named"), BAD_ADMISSIONS)
async def test_bad_admissions_write_nothing(setup, kwargs, named):
    tenant, run, _ = setup
    before = await raw_rows(tenant, play_scope(tenant), NS, ["name", "score"])
    port = CountingPort(tenant)
    rows = kwargs.pop("rows")
    with pytest.raises(InvalidInputError, match=named.replace("[", r"\[").replace("]", r"\]")):
        await admit(port, run, NS, CONTRACT, rows, **kwargs)
    assert port.boundaries == []
    assert await raw_rows(tenant, play_scope(tenant), NS, ["name", "score"]) == before


def bad_outcomes(key):
    return [
        ([RowOutcome(key, "completed", {"score": 1}), "not an outcome"], "outcomes[1]"),
        ([RowOutcome(key, "completed", {"score": float("inf")})], "outcomes[0].data.score"),
        ([RowOutcome(key, "completed", {"score": {"deep": {1, 2}}})], "outcomes[0].data.score.deep"),
        ([RowOutcome(key, "completed", {"": 1})], "field name must not be empty"),
        ([RowOutcome(key, "failed", cell_meta={"score": "not an object"})], "outcomes[0].cell_meta.score"),
        ([RowOutcome(key, "completed", cell_meta={"": {}})], "field name must not be empty"),
    ]


@pytest.mark.parametrize("case", range(6))
async def test_bad_completions_write_nothing(setup, case):
    tenant, run, key = setup
    outcomes, named = bad_outcomes(key)[case]
    before = await raw_rows(tenant, play_scope(tenant), NS, ["name", "score"])
    port = CountingPort(tenant)
    with pytest.raises(InvalidInputError, match=named.replace("[", r"\[").replace("]", r"\]")):
        await complete(port, run, NS, CONTRACT, outcomes)
    assert port.boundaries == []
    assert await raw_rows(tenant, play_scope(tenant), NS, ["name", "score"]) == before
    ok, detail = await counters_match(tenant, play_scope(tenant), NS)
    assert ok, detail


@pytest.mark.parametrize(
    ("build", "named"),
    [
        (lambda: RowOutcome("k", "done"), "status 'done'"),
        (lambda: RowOutcome("k", "COMPLETED"), "status"),
        (lambda: RowOutcome(7, "completed"), "key must be a string"),
        (lambda: RowOutcome("", "completed"), "key must have"),
        (lambda: RowOutcome("k", "completed", data=[1]), "data must be a dict"),
        (lambda: RowOutcome("k", "completed", input_index=-1), "input_index"),
        (lambda: RowOutcome("k", "failed", error=3), "error must be a str"),
        (lambda: SheetContract(inputs=("",)), "must not be empty"),
        (lambda: SheetContract(outputs=("a", 3)), "not a string"),
        (lambda: SheetContract(inputs=("a",), outputs=("b", "a")), "both as input and as output"),
        (lambda: SheetContract(inputs="name"), "sequence of field names"),
        (lambda: Attempt("", 1), "attempt_id"),
        (lambda: Attempt("a", -1), "seq"),
        (lambda: Attempt("a", 1, lease_s=float("nan")), "lease_s"),
        (lambda: CellPolicy(-1), "stale_after_s"),
    ],
)
def test_invalid_values_cannot_be_built(build, named):
    with pytest.raises(InvalidInputError, match=named):
        build()


async def test_wrong_contract_or_attempt_types_write_nothing(setup):
    tenant, run, key = setup
    port = CountingPort(tenant)
    with pytest.raises(InvalidInputError):
        await admit(port, run, NS, {"inputs": ["name"]}, [{"name": "a"}])
    with pytest.raises(InvalidInputError):
        await complete(port, run, NS, CONTRACT, [RowOutcome(key, "completed")], attempt="a1")
    with pytest.raises(InvalidInputError):
        await ensure_sheet(port, play_scope(tenant), NS, ("name",))
    with pytest.raises(InvalidInputError):
        await read_rows(port, play_scope(tenant), NS, limit=-1)
    assert port.boundaries == []


async def test_other_org_is_refused_before_any_query(setup):
    tenant, run, key = setup
    port = CountingPort(tenant)
    foreign = RunRef(RunScope("other-org", "play", "r1"), run.epoch)
    with pytest.raises(ScopeError):
        await admit(port, foreign, NS, CONTRACT, [{"name": "a"}])
    with pytest.raises(ScopeError):
        await complete(port, foreign, NS, CONTRACT, [RowOutcome(key, "completed")])
    with pytest.raises(ScopeError):
        await summary(port, PlayScope("other-org", "play"), NS)
    assert port.boundaries == []


async def test_any_other_field_name_works(tenant):
    odd_in = "key with spaces, ✓ and \"quotes\""
    odd_out = "x" * 80 + "\ud800!"  # a lone surrogate is cleaned to U+FFFD like jsonb keys
    clean_out = "x" * 80 + "\ufffd!"
    contract = SheetContract(inputs=(odd_in, "Name", "name"), outputs=(odd_out, "Status"))
    run = await new_run(tenant, "play", "r1")
    row = {odd_in: 1, "Name": 2, "name": 3}
    admission = await admit(tenant, run, NS, contract, [row])
    key = admission.pending[0].key
    assert key == row_key(row, NS)
    await complete(tenant, run, NS, contract, [
        RowOutcome(key, "completed", {clean_out: 4, "Status": 5})
    ])
    again = await admit(tenant, run, NS, contract, [row])
    assert [r.row for r in again.completed] == [
        {odd_in: 1, "Name": 2, "name": 3, clean_out: 4, "Status": 5}
    ]
    read = (await read_rows(tenant, play_scope(tenant), NS))[0]
    assert read["Name"] == 2 and read["name"] == 3 and read[clean_out] == 4
    assert read["Status"] == 5 and read["_key"] == key and read["_status"] == "enriched"


async def test_rows_admitted_with_their_encoded_texts_store_what_encoding_them_stores(tenant):
    """A list source hands admission the texts it encoded (`texts=`): the sheet holds exactly
    what admitting the rows alone would store."""
    from .sheet_helpers import encode_and_key

    contract = SheetContract(inputs=("name", "extra"), outputs=("score",))
    rows = [{"name": f"n{i}", "extra": None if i % 2 else [i, {"é": 1.5, "z": "\u2028"}]}
            for i in range(5)]
    encoded, keys = encode_and_key(rows, "with_texts")
    run = await new_run(tenant, "play", "r1")
    given = await admit(tenant, run, "with_texts", contract, encoded.rows, keys=keys,
                        texts=encoded.texts)
    plain = await admit(tenant, run, "without_texts", contract, rows)
    assert [r.key for r in given.pending] == [row_key(r, "with_texts") for r in rows]
    assert [r.row for r in given.pending] == [r.row for r in plain.pending]

    async def cells(namespace):
        stored = await raw_rows(tenant, play_scope(tenant), namespace, ["name", "extra"])
        return sorted((row["name"], str(row["extra"])) for row in stored.values())

    assert await cells("with_texts") == await cells("without_texts")


GIVEN_ROWS = [{"name": "a"}, {"name": "b"}, {"name": "c"}]
GIVEN_TEXTS = ['{"name":"a"}', '{"name":"b"}', '{"name":"c"}']


@pytest.mark.parametrize("keys, indexes, keep_rows, need_texts", [
    (["k1", "k2", "k3"], None, True, True),          # the column checks pass
    (["k1", "k2", "k3"], range(5, 8), False, False),
    (["k1", "k2", "k3"], [9, 4, 7], True, False),
    (["k1", "k2", "k1"], None, True, True),          # a duplicate: the first one wins
    (["k1", "ké", "k3"], [1, 2, 3], True, True),     # not ASCII: checked row by row
])
def test_given_keys_and_texts_prepare_as_the_row_loop_does(monkeypatch, keys, indexes, keep_rows,
                                                           need_texts):
    """`prepare_rows` checks rows whose keys and texts are given a column at a time; what it
    answers is what its row-by-row loop answers."""
    from runplane.engine.sheets import inputs

    def prepare():
        return inputs.prepare_rows(GIVEN_ROWS, "ns", input_offset=2, keys=keys,
                                   need_texts=need_texts, input_indexes=indexes,
                                   keep_rows=keep_rows, texts=GIVEN_TEXTS)

    fast = prepare()
    monkeypatch.setattr(inputs, "_given_rows", lambda *args: None)
    assert fast == prepare()


@pytest.mark.parametrize("change, message", [
    ({"keys": ["k1", "", "k3"]}, r"keys\[1\]: key "),
    ({"keys": ["k1", "k\x00", "k3"]}, r"keys\[1\]: key holds NUL"),
    ({"keys": ["k1", 2, "k3"]}, r"keys\[1\]: key must be a string"),
    ({"texts": [GIVEN_TEXTS[0], None, GIVEN_TEXTS[2]]}, r"texts\[1\] must be a string"),
    ({"rows": [GIVEN_ROWS[0], ["x"], GIVEN_ROWS[2]]}, r"rows\[1\] must be a dict"),
    ({"input_indexes": [0, -1, 2]}, r"input_indexes\[1\] must be an integer from 0 to"),
    ({"input_indexes": [0, True, 2]}, r"input_indexes\[1\] must be an integer from 0 to"),
    ({"input_indexes": range(-1, 2)}, r"input_indexes\[0\] must be an integer from 0 to"),
    ({"input_indexes": [0, 2**63, 2]}, r"input_indexes\[1\] must be an integer from 0 to"),
    ({"input_indexes": range(2**63 - 2, 2**63 + 1)},
     r"input_indexes\[2\] must be an integer from 0 to"),
])
def test_given_keys_and_texts_refuse_naming_the_row(change, message):
    from runplane.engine.sheets.inputs import prepare_rows

    arguments = {"rows": GIVEN_ROWS, "keys": ["k1", "k2", "k3"], "texts": GIVEN_TEXTS,
                 "input_indexes": None, **change}
    with pytest.raises(InvalidInputError, match=message):
        prepare_rows(arguments["rows"], "ns", input_offset=0, keys=arguments["keys"],
                     need_texts=True, input_indexes=arguments["input_indexes"],
                     texts=arguments["texts"])


@pytest.mark.parametrize("keys, texts", [(None, None), (["k1", "k2", "k3"], GIVEN_TEXTS)])
def test_an_index_past_a_bigint_is_refused_before_any_query(keys, texts):
    """An input index the sheet's bigint cannot hold, given or from the offset, is an
    `InvalidInputError` of the call (the driver would refuse it inside the transaction)."""
    from runplane.engine.limits.inputs import MAX_INPUT_INDEX
    from runplane.engine.sheets.inputs import prepare_rows

    last = prepare_rows(GIVEN_ROWS, "ns", input_offset=MAX_INPUT_INDEX - 2, keys=keys,
                        need_texts=True, texts=texts)
    assert last.indexes[-1] == MAX_INPUT_INDEX
    with pytest.raises(InvalidInputError, match="input indexes past"):
        prepare_rows(GIVEN_ROWS, "ns", input_offset=MAX_INPUT_INDEX - 1, keys=keys,
                     need_texts=True, texts=texts)
    with pytest.raises(InvalidInputError, match=r"input_indexes\[0\] must be an integer"):
        prepare_rows(GIVEN_ROWS, "ns", input_offset=0, keys=keys, need_texts=True, texts=texts,
                     input_indexes=[MAX_INPUT_INDEX + 1, 0, 1])
