"""The actions a gateway client sends its own way: `sheets.admit` and `sheets.complete` in
pages under the body limit, `sheets.probe` in one request.

How it works
- Admission and completion are validated, keyed and deduplicated here exactly as the engine
  would, then paged under the body limit (`engine.gateway.paging`) and their answers merged;
  an admission page whose answer disagrees with the page sent is a `ConflictError`.
- An admission's pending rows come back by key, or as input indexes alone
  (`protocol.ROWS_HEADER`): the client puts back the rows it sent. Every page of one
  completion shares one retry budget, so the completion's total deadline holds for the whole
  call. A completion's diagnostics go to its sink through
  the gateway's own background queue (`engine.diagnostics`), so a sink never delays it.
- Outcomes travel in the form of the one `RowOutcome` codec (`sheets.model.ROW_OUTCOME`), each
  encoded once: its size is what the pager counts. A plain completed outcome leaves out the
  fields the codec defaults (null, one attempt), as every server's codec reads it. Its text
  is written from the data and cell meta texts `prepare_outcomes` already made, so no
  outcome's data is checked or encoded twice.
- An admission page's pending rows (by key or by index) are decoded straight into the rows
  this call sent.
- Newer forms go only to a gateway whose health lists them (`protocol.FEATURES`,
  `protocol.ARRAY_FEATURES`): an admission's `expect_new` is left out and its pending rows
  asked by key otherwise; `array_input.open_list_map` is refused here when unlisted or
  outside the token's `actions` claim (the caller opens the map with three calls), and a
  `put_and_seal` with begin fields goes to an older gateway as `begin`, then `put_and_seal`
  without them; a `retire_entry` that records the entry pending goes to it as
  `outbox.mark_pending`, then `retire_entry`.
"""

from __future__ import annotations

import json
import time
from operator import attrgetter
from typing import TYPE_CHECKING, Awaitable, Callable, Mapping, Sequence

import attrs

from ..limits.bounds import is_int
from ..tokens import allows
from ..actions import Action
from ..canonical import JsonObject, JsonValue
from ..array_input import facts
from ..array_input.values import DONE_ALREADY
from ..errors import ArrayInputUnavailableError, InvalidInputError, ScopeError
from ..runs import outbox
from ..values.scopes import normalize_namespace
from ..sheets.model import check_give_up_after
from ..sheets.completion import deliver_diagnostics
from ..sheets.inputs import check_input_indexes, prepare_rows
from ..sheets.outcome_inputs import PreparedOutcome, prepare_outcomes
from ..sheets.previous_cells import PREVIOUS, cells_bytes, with_previous
from ..sheets.sheet_write import check_write
from ..sheets.model import (
    ROW_OUTCOME, Admission, AdmittedRow, Completion, CompletionDiagnostics, OutcomeStatus,
    RowOutcome, Timing,
)
from . import paging, protocol

if TYPE_CHECKING:
    from .client import Gateway

COMPLETION_ACTION = "sheets.complete"

_ROWS_BY_KEY = {protocol.ROWS_HEADER: protocol.ROWS_BY_KEY}
_ROWS_BY_INDEX = {protocol.ROWS_HEADER: protocol.ROWS_BY_INDEX}

_PENDING_FIELDS = frozenset({"key", "input_index", "row"})


def decode_admitted_page(action: Action, answer: JsonValue, row_of: Mapping[str, JsonObject],
                         key_at: Mapping[int, str] | None = None) -> Admission:
    """An admission page's answer, its pending rows carrying the rows this call sent
    (`row_of`, by key): they come back by key (`ROWS_HEADER`), so each pending entry is
    checked as the codec checks an `AdmittedRow` and built once, with the client's row. A key
    the call did not send keeps the row answered (`check_admitted_page` then refuses it). A
    pending row's previous cells come back with it and join the client's row. Asked by index
    (`key_at`: the page's keys by input index), pending rows that come back as input indexes
    alone are the page's rows at those indexes; an index the page did not send is refused."""
    pending = answer.get("pending") if type(answer) is dict else None
    if type(pending) is not list:
        return action.result.decode(answer, "result")  # the codec names what is wrong
    page = action.result.decode({**answer, "pending": []}, "result")
    if key_at is not None and all([type(index) is int for index in pending]):
        return attrs.evolve(page, pending=tuple(_rows_at(pending, key_at, row_of)))
    rows = []
    for i, item in enumerate(pending):
        if type(item) is not dict or type(item.get("key")) is not str \
                or type(item.get("input_index")) is not int or not _PENDING_FIELDS.issuperset(item) \
                or "row" not in item:
            action.result.decode(answer, "result")  # raises, naming the entry
            raise InvalidInputError(f"result.pending[{i}] is not an admitted row")
        key, answered = item["key"], item["row"]
        row = row_of.get(key, answered)
        if row is not answered and type(answered) is dict and PREVIOUS in answered:
            row = with_previous(row, answered[PREVIOUS])  # the only field answered by key
        rows.append(AdmittedRow(key, item["input_index"], row))
    return attrs.evolve(page, pending=tuple(rows))


def _rows_at(indexes: list[int], key_at: Mapping[int, str],
             row_of: Mapping[str, JsonObject]) -> list[AdmittedRow]:
    keys = list(map(key_at.get, indexes))
    if None in keys:
        index = indexes[keys.index(None)]
        raise paging.disagree(f"a pending row at input index {index} was not sent")
    return list(map(AdmittedRow, keys, indexes, map(row_of.__getitem__, keys)))


async def _send_admit_staged(gateway: Gateway, action: Action, arguments: dict,
                             namespace: str, offset: int) -> Admission:
    """`sheets.admit` of one sealed page (at most 1,000 rows, its fact at most 1 MiB): one
    request, unpaged; the server checks it and reads the rows' inputs from the stored fact.
    The client has the rows, so their pending ones come back as input indexes (by key, with
    their previous cells, when those are asked for, or from a gateway that does not list the
    form) and are checked against what was sent, as a paged admission's are."""
    body = protocol.dumps(action.encode_input(
        {name: value for name, value in arguments.items() if name != "texts"}))
    # as the server prepares them: the pending rows are these (deduplicated, normalized)
    prepared = prepare_rows(arguments["rows"], namespace, input_offset=offset,
                            keys=arguments.get("keys"), need_texts=False,
                            texts=arguments.get("texts"))
    sent = dict(zip(prepared.keys, prepared.indexes))
    by_index = (not arguments.get("previous_cells")
                and protocol.ADMIT_BY_INDEX in (await gateway.health()).features)
    answer = await gateway.post(action, body, headers=_ROWS_BY_INDEX if by_index
                                else _ROWS_BY_KEY)
    page = decode_admitted_page(action, answer, dict(zip(prepared.keys, prepared.rows)),
                                dict(zip(prepared.indexes, prepared.keys)) if by_index else None)
    paging.check_admitted_page(page, sent, arguments["run"].epoch)
    return page


async def _send_admit(gateway: Gateway, action: Action, arguments: dict) -> Admission:
    """`sheets.admit` in pages under the body limit, answers merged (see `paging`);
    `expect_new` only to a gateway that lists it (an older one refuses the field, and the
    admission is the same without it)."""
    started = time.perf_counter()
    if "expect_new" in arguments \
            and protocol.ADMIT_EXPECT_NEW not in (await gateway.health()).features:
        arguments = {name: value for name, value in arguments.items() if name != "expect_new"}
    run, contract = arguments["run"], arguments["contract"]
    attempt = arguments.get("attempt")
    check_write(gateway, run, contract, attempt)
    namespace = normalize_namespace(arguments["table_namespace"])
    rows = arguments["rows"]
    offset = arguments.get("input_offset", 0)
    indexes = arguments.get("input_indexes")
    if not is_int(offset, 0):
        raise InvalidInputError(f"input_offset must be an integer >= 0, got {offset!r}")
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence):
        raise InvalidInputError("rows must be a sequence of dicts")
    if indexes is not None:
        check_input_indexes(indexes, len(rows))
    check_give_up_after(arguments.get("give_up_after"))
    if arguments.get("staged_page") is not None:
        return await _send_admit_staged(gateway, action, arguments, namespace, offset)
    # Positions ride in as input indexes, so every unique row keeps its place in the call.
    prepared = prepare_rows(rows, namespace, input_offset=0, keys=arguments.get("keys"),
                            need_texts=True, input_indexes=range(len(rows)),
                            texts=arguments.get("texts"))
    positions = prepared.indexes
    final = [indexes[p] for p in positions] if indexes is not None else [offset + p for p in positions]
    # Everything but the rows travels in every page (a new parameter of admit does too).
    arrays = ("rows", "keys", "input_indexes")
    fixed = action.encode_input({name: value for name, value in arguments.items()
                                 if name not in arrays and name not in ("input_offset", "texts")})
    health = await gateway.health()
    room = paging.room_for_rows(fixed, arrays, health.body_limit, "rows")
    key_texts = list(map(_string, prepared.keys))  # as `protocol.dumps` writes each
    index_texts = list(map(str, final))
    assert prepared.texts is not None
    sizes = [paging.utf8_size(row) + paging.utf8_size(key) + len(index) + 3
             for row, key, index in zip(prepared.texts, key_texts, index_texts)]
    results: list[Admission] = []
    row_of = dict(zip(prepared.keys, prepared.rows))
    # pending rows as input indexes alone: to a gateway that lists it, when every row has its
    # own index and no previous cells come back
    by_index = (not arguments.get("previous_cells") and len(set(final)) == len(final)
                and protocol.ADMIT_BY_INDEX in health.features)
    budget = arguments.get("previous_cells_budget_bytes") if arguments.get("previous_cells") \
        else None
    for start, end in paging.pack(sizes, positions, room, "rows"):
        if budget is not None and results:  # the pages of one call share its budget
            budget = max(0, budget - sum(cells_bytes(row.row.get(PREVIOUS))
                                         for row in results[-1].pending))
            fixed["previous_cells_budget_bytes"] = budget
        body = paging.page_body(fixed, [("rows", prepared.texts[start:end]),
                                        ("keys", key_texts[start:end]),
                                        ("input_indexes", index_texts[start:end])])
        sent = dict(zip(prepared.keys[start:end], final[start:end]))
        answer = await gateway.post(action, body, headers=_ROWS_BY_INDEX if by_index
                                    else _ROWS_BY_KEY)
        page = decode_admitted_page(action, answer, row_of, dict(zip(
            final[start:end], prepared.keys[start:end])) if by_index else None)
        paging.check_admitted_page(page, sent, run.epoch)
        results.append(page)
    elapsed_ms = (time.perf_counter() - started) * 1000.0
    return Admission(
        inserted=sum(page.inserted for page in results),
        skipped=prepared.skipped + sum(page.skipped for page in results),
        pending=tuple(row for page in results for row in page.pending),
        completed=tuple(row for page in results for row in page.completed),
        blocked=tuple(row for page in results for row in page.blocked),
        cached=sum(page.cached for page in results),
        write_version=run.epoch,
        timings=(Timing("gateway_pages", round(elapsed_ms, 3), len(rows)),
                 *(timing for page in results for timing in page.timings)),
    )


_OUTCOME_FIELDS = ("key", "status", "data", "input_index", "cell_meta", "error", "attempts",
                   "cause")
_TEXT_OF_OUTCOMES = tuple(field.name for field in attrs.fields(RowOutcome)) == _OUTCOME_FIELDS
_string = json.encoder.encode_basestring  # what `protocol.dumps` writes for a string


def outcome_texts(outcomes: Sequence[RowOutcome],
                  prepared: Sequence[PreparedOutcome]) -> list[str]:
    """The wire text of each prepared outcome (`prepare_outcomes`: the last one given for each
    key): what `ROW_OUTCOME` decodes back to the outcome given, with the error message as
    prepared (normalized, so it is valid UTF-8) and its cause as prepared when one was given
    (without one, the server takes the message's, as `prepare_outcomes` does here). Written
    from the texts `prepare_outcomes` already made (data and cell meta normalized and encoded
    once), field by field in the codec's order. A plain completed outcome (an index, one
    attempt, no cell meta) leaves out the fields the codec defaults (a third of its text);
    an outcome of an unexpected shape goes through the codec itself, which names what is
    wrong."""
    if _TEXT_OF_OUTCOMES and prepared and len(prepared) == len(outcomes):
        plain = _plain_texts(outcomes, prepared)
        if plain is not None:
            return plain
    last = {outcome.key: (i, outcome) for i, outcome in enumerate(outcomes)}
    dumps = protocol.dumps
    texts = []
    for one in prepared:
        position, outcome = last[one.key]
        index, attempts = outcome.input_index, outcome.attempts
        cause = None if outcome.cause is None else one.cause  # none given: the server's own
        if _TEXT_OF_OUTCOMES and type(attempts) is int and (index is None or type(index) is int):
            meta = outcome.cell_meta
            if attempts == 1 and meta is None and not one.failed and type(index) is int \
                    and outcome.data is not None:
                texts.append(_plain_text(_string(one.key), one.data_text, index))
                continue
            texts.append(
                f'{{"key":{_string(one.key)},'
                f'"status":{_FAILED if one.failed else _COMPLETED},'
                f'"data":{"null" if outcome.data is None else one.data_text},'
                f'"input_index":{"null" if index is None else int.__repr__(index)},'
                f'"cell_meta":{"null" if meta is None else one.meta_text or "{}"},'
                f'"error":{"null" if one.error is None else _string(one.error)},'
                f'"attempts":{int.__repr__(attempts)},'
                f'"cause":{"null" if cause is None else _string(cause)}}}')
            continue
        if outcome.error != one.error or outcome.cause != cause:
            outcome = attrs.evolve(outcome, error=one.error, cause=cause)
        texts.append(dumps(ROW_OUTCOME.encode(outcome, f"outcomes[{position}]")).decode("utf-8"))
    return texts


_COMPLETED, _FAILED = _string(OutcomeStatus.COMPLETED.value), _string(OutcomeStatus.FAILED.value)


def _plain_text(key_text: str, data_text: str, index: int) -> str:
    """A plain completed outcome's text: its key (as JSON), its data's text and its index (an
    `int`), the fields the codec defaults left out."""
    return f'{{"key":{key_text},"status":{_COMPLETED},"data":{data_text},"input_index":{index}}}'


def _plain_texts(outcomes: Sequence[RowOutcome],
                 prepared: Sequence[PreparedOutcome]) -> list[str] | None:
    """`outcome_texts` of outcomes with no key twice (each prepared at its own position) when
    every one is a plain completed outcome, written a field at a time (each step one pass in
    C); None otherwise."""
    (keys, failed, indexes, data_texts, _metas, _errors, _data_keys, _meta_keys, _sizes,
     attempts, _causes) = zip(*prepared)
    if any(failed) or set(attempts) != {1} or set(map(type, indexes)) != {int} \
            or list(map(_META, outcomes)).count(None) != len(outcomes) \
            or None in list(map(_DATA, outcomes)):
        return None
    return list(map(_plain_text, map(_string, keys), data_texts, indexes))


_META, _DATA = attrgetter("cell_meta"), attrgetter("data")


async def _send_complete(gateway: Gateway, action: Action, arguments: dict) -> Completion:
    """`sheets.complete` in pages under the body limit, one total deadline for all of them."""
    run, contract = arguments["run"], arguments["contract"]
    check_write(gateway, run, contract, arguments.get("attempt"))
    normalize_namespace(arguments["table_namespace"])
    outcomes = arguments["outcomes"]
    prepared, input_rows = prepare_outcomes(outcomes)
    budget = gateway.budget(action.name)
    fixed = action.encode_input({name: value for name, value in arguments.items()
                                 if name != "outcomes"})  # local parameters never travel
    health = await gateway.health()
    room = paging.room_for_rows(fixed, ("outcomes",), health.body_limit, "outcomes")
    texts = outcome_texts(outcomes, prepared)
    sizes = [paging.utf8_size(text) + 1 for text in texts]
    positions = list(range(len(prepared)))
    results: list[Completion] = []
    for start, end in paging.pack(sizes, positions, room, "outcomes"):
        body = paging.page_body(fixed, [("outcomes", texts[start:end])])
        results.append(action.result.decode(await gateway.post(action, body, budget), "result"))
    diagnostics = _merge_diagnostics([page.diagnostics for page in results], input_rows)
    sink = arguments.get("on_diagnostics")
    if sink is not None and diagnostics is not None:
        if gateway.diagnostics.running:  # the gateway's task calls the sink, never this call
            gateway.diagnostics.put(sink, diagnostics)
        else:
            await deliver_diagnostics(sink, diagnostics)
    return Completion(
        updated=sum(page.updated for page in results),
        committed_keys=tuple(key for page in results for key in page.committed_keys),
        fenced=tuple(row for page in results for row in page.fenced),
        diagnostics=diagnostics,
    )


def _merge_diagnostics(pages: list[CompletionDiagnostics | None], input_rows: int):
    pages = [page for page in pages if page is not None]
    if not pages:
        return None
    if len(pages) == 1:
        return attrs.evolve(pages[0], input_rows=input_rows)
    merged: dict[str, int | str] = {}
    for field in attrs.fields(CompletionDiagnostics):
        values = [getattr(page, field.name) for page in pages]
        if field.name == "outcome":
            merged["outcome"] = "failed" if "failed" in values else "succeeded"
        else:
            merged[field.name] = sum(values)
    merged["input_rows"] = input_rows
    return CompletionDiagnostics(**merged)


async def _send_probe(gateway: Gateway, action: Action, arguments: dict) -> Admission | None:
    """`sheets.probe` in one request. A call too large for one request is answered None, as a
    probe that settles nothing: the caller then admits (which pages). A probe is a shortcut."""
    body = protocol.dumps(action.encode_input(arguments))
    health = await gateway.health()
    if len(body) > health.body_limit - protocol.PAGE_HEADROOM:
        return None
    return action.result.decode(await gateway.post(action, body), "result")


async def _send_open_list_map(gateway: Gateway, action: Action, arguments: dict) -> object:
    """`array_input.open_list_map`, an optional shortcut: refused here, with the error the
    gateway would answer and no request, when the gateway does not list it (an older one, or
    one without array actions) or the token's actions claim does not allow it. The caller then
    opens the map with the three calls it stands for."""
    if protocol.OPEN_LIST_MAP not in (await gateway.health()).features:
        raise ArrayInputUnavailableError(
            f"{action.name}: {gateway.url} does not list it among its features")
    if gateway.token_actions is not None and not allows(gateway.token_actions, action.name):
        raise ScopeError(f"the token's actions claim does not allow {action.name}")
    return await gateway.call(action, arguments)


async def _send_put_and_seal(gateway: Gateway, action: Action, arguments: dict) -> object:
    """`array_input.put_and_seal`; to a gateway that does not list its begin fields (an older
    one), the begin fact goes first in a request of its own and the call without them."""
    if protocol.PUT_AND_SEAL_BEGINS in (await gateway.health()).features:
        return await gateway.call(action, arguments)
    arguments = dict(arguments)
    begins = arguments.pop("has_source_identities", None)
    if begins is not None:
        await facts.begin(gateway, arguments["scope"],
                          source_fingerprint=arguments["source_fingerprint"],
                          source_rows=arguments["source_rows"], has_source_identities=begins)
    return await gateway.call(action, arguments)


async def _send_retire_entry(gateway: Gateway, action: Action, arguments: dict) -> object:
    """`array_input.retire_entry`; to a gateway that does not list `record_lease_s` (an older
    one), the terminal entry is recorded pending first in a request of its own
    (`outbox.mark_pending`), as the call would."""
    lease_s = arguments.get("record_lease_s")
    if lease_s is None or protocol.RETIRE_RECORDS in (await gateway.health()).features:
        return await gateway.call(action, arguments)
    arguments = dict(arguments)
    del arguments["record_lease_s"]
    if not await outbox.mark_pending(gateway, arguments["scope"], arguments["owner"], lease_s):
        return DONE_ALREADY
    return await gateway.call(action, arguments)


SENDERS: dict[str, Callable[[Gateway, Action, dict], Awaitable[object]]] = {
    "sheets.admit": _send_admit,
    "sheets.probe": _send_probe,
    COMPLETION_ACTION: _send_complete,
    protocol.OPEN_LIST_MAP: _send_open_list_map,
    "array_input.put_and_seal": _send_put_and_seal,
    "array_input.retire_entry": _send_retire_entry,
}


