"""An action request's body and headers as the gateway server reads and answers them.

- `decode_body` decodes and checks a body (an admission's rows validated, keyed and encoded
  here, off the event loop for large bodies: the server decides where it runs).
- `encode_result` writes the answer's JSON (an admission answered by key sends pending rows'
  keys and indexes only, and their previous cells when they have some; by index, their input
  indexes alone).
- `read_body` reads a body from ASGI `receive`, refusing it (`Refusal`, 413) as soon as it grows
  past the server's limit: the rest is never read.
- `RequestHeaders` holds the few headers an action reads (`READ_HEADERS`), by lowercase name.
"""

from __future__ import annotations

from operator import attrgetter, methodcaller
from typing import Iterable

import attrs
from starlette.types import Receive

from .. import canonical
from ..actions import Action
from ..values.scopes import normalize_namespace
from ..errors import InvalidInputError
from ..sheets import OutcomeStatus, RowOutcome
from ..sheets.inputs import prepare_rows, text_keys
from ..sheets.outcome_inputs import PreparedOutcome, prepared_completed_many
from ..sheets.previous_cells import PREVIOUS
from . import guards, protocol

ADMIT_ACTION = "sheets.admit"
COMPLETE_ACTION = "sheets.complete"
_OUTCOME_FIELDS = frozenset(attrs.fields_dict(RowOutcome))
_OUTCOME_WIDTH = len(_OUTCOME_FIELDS)
_COMPLETED = OutcomeStatus.COMPLETED.value


class Refusal(Exception):
    """A request refused before its action ran, with its wire code and status."""

    def __init__(self, message: str, code: str, status: int) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


async def read_body(receive: Receive, limit: int) -> bytes:
    """The request body from ASGI `receive`: `Refusal` (413) as soon as it grows past `limit`
    bytes (the rest is never read); a client that went away before its body arrived is a
    `Refusal` too (499, `client_disconnected`: counted, answered to nobody, no traceback)."""
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise Refusal("the client went away before its request body arrived",
                          "client_disconnected", 499)
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise Refusal(f"the request body is over the limit of {limit} bytes",
                              *protocol.BODY_TOO_LARGE)
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def decode_body(spec: Action, raw: bytes) -> tuple[dict[str, object], int]:
    """Decode and check a body; for an admission also validate, normalize, key and encode its
    rows here (the engine then takes them as they are), ignoring any `texts` the client sent:
    the input cells stored are always the rows' own canonical texts. Answers the keyword
    arguments and the number of duplicate rows dropped (the answer's `skipped` adds them).
    A completion whose outcomes are all plain completed ones decodes them the short way
    (`completed_outcomes`)."""
    body = guards.loads(raw, spec.name)
    if spec.name == COMPLETE_ACTION and type(body) is dict:
        outcomes = completed_outcomes(body.get("outcomes"))
        if outcomes is not None:
            kwargs = spec.decode_input({**body, "outcomes": []})
            kwargs["outcomes"] = outcomes
            return kwargs, 0
    kwargs = spec.decode_input(body)
    if spec.name != ADMIT_ACTION:
        return kwargs, 0
    kwargs.pop("texts", None)
    if not kwargs["contract"].inputs or kwargs.get("staged_page") is not None:
        return kwargs, 0
    rows, keys = kwargs["rows"], kwargs.get("keys")
    namespace = normalize_namespace(kwargs["table_namespace"])
    texts = canonical.canonical_texts(rows)  # the decoder's own rows: uncopied when canonical
    if texts is not None and keys is None:
        keys = text_keys(namespace, texts)
    prepared = prepare_rows(
        rows, namespace, input_offset=kwargs.get("input_offset", 0), keys=keys, need_texts=True,
        input_indexes=kwargs.get("input_indexes"), texts=texts)
    kwargs.update(rows=prepared.rows, keys=prepared.keys, texts=prepared.texts,
                  input_indexes=prepared.indexes)
    return kwargs, prepared.skipped


def completed_outcomes(items: object) -> list[PreparedOutcome] | None:
    """The outcomes of a completion body when every one is a plain completed outcome (status
    `completed`, an object of data, no error, cause or cell meta, given as null or left out):
    checked, normalized and encoded once by `prepared_completed_many`, a field at a time, as a
    map's worker prepares its own, so the completion neither decodes them through the codec
    nor builds a `RowOutcome` of each, nor checks and encodes their data again. None for any
    other list: the codec then decodes it whole, and names what is wrong with which outcome."""
    if type(items) is not list or set(map(type, items)) != {dict}:
        return None
    if not all(map(_PLAIN_FIELDS.issuperset, items)) and not all(map(_nulls_beside, items)):
        return None
    if set(map(_STATUS, items)) != {_COMPLETED}:
        return None
    datas = list(map(_DATA, items))
    if set(map(type, datas)) != {dict}:
        return None
    try:
        return prepared_completed_many(list(map(_KEY, items)), datas, list(map(_INDEX, items)),
                                       list(map(_ATTEMPTS, items)))
    except InvalidInputError:
        return None


_PLAIN_FIELDS = frozenset({"key", "status", "data", "input_index", "attempts"})
_KEY, _STATUS, _DATA, _INDEX = (methodcaller("get", name) for name in (
    "key", "status", "data", "input_index"))
_ATTEMPTS = methodcaller("get", "attempts", 1)


def _nulls_beside(item: dict) -> bool:
    """An outcome whose fields beyond a plain completed one's are all null."""
    return len(item) <= _OUTCOME_WIDTH and _OUTCOME_FIELDS.issuperset(item) \
        and item.get("error") is None and item.get("cause") is None \
        and item.get("cell_meta") is None


def encode_result(spec: Action, result: object, skipped: int, rows_form: str | None) -> bytes:
    """The answer's JSON. `skipped` duplicates were dropped while the rows were prepared (the
    answer counts them). With a `rows_form` (`protocol.ROWS_HEADER`) the client has the rows:
    by key, pending rows carry their keys and indexes only (`{"key", "input_index", "row": {}}`,
    as the codec writes an `AdmittedRow`, built here without one per row), and their previous
    cells when admission gave them some (`"row": {"_previous": ...}`: the client merges them
    into its row); by index, each pending row is its input index alone — unless one has
    previous cells, and then they go by key."""
    if skipped:
        result = attrs.evolve(result, skipped=result.skipped + skipped)
    if rows_form is None:
        return protocol.dumps({"result": spec.result.encode(result, "result")})
    encoded = spec.result.encode(attrs.evolve(result, pending=()), "result")
    pending = result.pending
    if rows_form == protocol.ROWS_BY_INDEX \
            and not any(map(_HAS_PREVIOUS, map(_ROW, pending))):  # each one pass in C
        encoded["pending"] = list(map(_INDEX_OF, pending))
    else:
        encoded["pending"] = [{"key": row.key, "input_index": row.input_index,
                               "row": _previous_only(row.row)} for row in pending]
    return protocol.dumps({"result": encoded})


_ROW, _INDEX_OF = attrgetter("row"), attrgetter("input_index")
_HAS_PREVIOUS = methodcaller("__contains__", PREVIOUS)


def _previous_only(row: dict) -> dict:
    """What an answer by key sends of a pending row: its previous cells, if it has them."""
    return {PREVIOUS: row[PREVIOUS]} if PREVIOUS in row else {}


READ_HEADERS = frozenset({b"content-length", b"authorization", protocol.REQUEST_ID_HEADER.encode(),
                           protocol.ROWS_HEADER.encode(), protocol.HEALTH_HEADER.encode(),
                           b"traceparent", b"tracestate"})
JSON_CONTENT_TYPE = (b"content-type", b"application/json")


class RequestHeaders:
    """The request headers an action reads, by lowercase name (the first of repeated ones)."""

    __slots__ = ("_values",)

    def __init__(self, items: Iterable[tuple[str, str]]) -> None:
        values: dict[str, str] = {}
        for key, value in items:
            values.setdefault(key.lower(), value)
        self._values = values

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._values.get(name, default)
