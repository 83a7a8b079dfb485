"""A pure model of one run's array input, and the invariants a simulation checks against it.

How it works
- `ArrayModel` knows the source every stager puts (its drafts, their page digests and the seal's
  expected digest chain) and records every call the actors made as an `Event` on a logical
  clock: `begin_call` ticks at the call's start, `end_call` at its end (trio runs one task at a
  time, so the order is total). It does no I/O.
- `check(stored)` takes what the store holds for the run at the end of an example
  (`StoredFact`s) and returns the violated invariants, in words:
    1. once a retire call returned done, no call that started later succeeded (retire aside),
       and the run holds nothing but its guard, marked retired;
    2. a seal fact exists only for the whole source: its page count, row count and digest chain
       are the ones every page of the source verified gives;
    3. every stored page is the source's page at that ordinal (pages are write-once), unless
       the simulation tampered with it;
    4. a page `read_page` returned is exactly the source's page (never unverified bytes);
    5. every error is one the operation may raise in this scenario.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import attrs

from runplane.engine.array_input import Occurrence, PageDraft, paginate, source_fingerprint
from runplane.engine.array_input.pages import encode_page
from runplane.engine.canonical import normalize

Op = Literal["begin", "put_page", "seal", "read_page", "get_manifest", "retire"]

# Errors an operation may raise whatever the interleaving: the run was retired, or a fault hit
# it. `CorruptFactError` is also fine for a seal that ran before every page was put, and for
# reads of a tampered page.
ALWAYS_ALLOWED = frozenset({"RetiredError", "StoreUnavailableError", "cancelled"})


@attrs.frozen
class Event:
    actor: str
    op: Op
    start: int
    end: int
    outcome: str  # "ok", "cancelled", or the exception's class name
    detail: object = None  # the return value (a RetireResult, a Page, a Manifest) when ok


@attrs.frozen
class StoredFact:
    kind: str
    ordinal: int | None
    output: dict


@attrs.define(eq=False)
class ArrayModel:
    source: list[Occurrence]
    drafts: list[PageDraft] = attrs.field(init=False)
    fingerprint: str = attrs.field(init=False)
    page_digests: list[str] = attrs.field(init=False)
    chain: str = attrs.field(init=False)
    events: list[Event] = attrs.field(init=False, factory=list)
    tampered: set[int] = attrs.field(init=False, factory=set)
    clock: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self.fingerprint = source_fingerprint(self.source)
        self.drafts = paginate(self.source)
        self.page_digests = [
            encode_page(self.fingerprint, d.ordinal, d.offset, d.rows).digest for d in self.drafts
        ]
        hasher = hashlib.sha256()
        for digest in self.page_digests:
            hasher.update(digest.encode())
        self.chain = hasher.hexdigest()

    @property
    def source_rows(self) -> int:
        return len(self.source)

    @property
    def page_count(self) -> int:
        return len(self.drafts)

    @property
    def has_source_identities(self) -> bool:
        return any(o.source_identity is not None for o in self.source)

    # -- recording -----------------------------------------------------------------------------
    def begin_call(self) -> int:
        self.clock += 1
        return self.clock

    def end_call(self, actor: str, op: Op, start: int, outcome: str,
                 detail: object = None) -> Event:
        self.clock += 1
        event = Event(actor, op, start, self.clock, outcome, detail)
        self.events.append(event)
        return event

    def record_tamper(self, ordinal: int) -> None:
        self.tampered.add(ordinal)

    # -- invariants ----------------------------------------------------------------------------
    def retired_done_at(self) -> int | None:
        ends = [e.end for e in self.events
                if e.op == "retire" and e.outcome == "ok" and e.detail.done]
        return min(ends) if ends else None

    def check(self, stored: list[StoredFact]) -> list[str]:
        violations: list[str] = []
        violations += self._check_errors()
        violations += self._check_after_retirement(stored)
        violations += self._check_seal(stored)
        violations += self._check_pages(stored)
        violations += self._check_reads()
        return violations

    def _check_errors(self) -> list[str]:
        out = []
        for e in self.events:
            if e.outcome == "ok" or e.outcome in ALWAYS_ALLOWED:
                continue
            if e.outcome == "CorruptFactError" and e.op == "seal":
                continue  # sealed before every page was put, or a tampered page
            if e.outcome == "CorruptFactError" and e.op == "read_page" and self.tampered:
                continue
            out.append(f"{e.actor}: {e.op} raised {e.outcome} (at {e.start}..{e.end})")
        return out

    def _check_after_retirement(self, stored: list[StoredFact]) -> list[str]:
        done_at = self.retired_done_at()
        if done_at is None:
            return []
        out = [
            f"{e.actor}: {e.op} started at {e.start}, after retirement was done at {done_at}, "
            f"and succeeded"
            for e in self.events
            if e.start > done_at and e.op != "retire" and e.outcome == "ok"
        ]
        kinds = sorted(f.kind for f in stored)
        if kinds != ["array_input_guard"]:
            out.append(f"retirement was done but the run still holds {kinds}")
        elif stored[0].output.get("retired") is not True:
            out.append(f"retirement was done but the guard says {stored[0].output}")
        return out

    def _check_seal(self, stored: list[StoredFact]) -> list[str]:
        seals = [f.output for f in stored if f.kind == "array_input_seal"]
        if not seals:
            sealed_ok = [e for e in self.events if e.op == "seal" and e.outcome == "ok"]
            retiring = any(e.op == "retire" for e in self.events)
            if sealed_ok and not retiring:
                return [f"{sealed_ok[0].actor}: seal succeeded but no seal fact is stored"]
            return []
        seal = seals[0]
        expected = {
            "kind": "array_input_seal", "source_fingerprint": self.fingerprint,
            "source_rows": self.source_rows, "has_source_identities": self.has_source_identities,
            "page_count": self.page_count, "digest_chain": self.chain,
        }
        if seal != expected:
            return [f"stored seal {seal} is not the seal of the whole verified source {expected}"]
        return []

    def _check_pages(self, stored: list[StoredFact]) -> list[str]:
        out = []
        for fact in stored:
            if fact.kind != "array_input_page" or fact.ordinal in self.tampered:
                continue
            ordinal = fact.ordinal
            if ordinal is None or not 0 <= ordinal < self.page_count:
                out.append(f"a page fact at ordinal {ordinal} is outside the source")
            elif fact.output.get("digest") != self.page_digests[ordinal]:
                out.append(f"stored page {ordinal} is not the source's page")
        return out

    def _check_reads(self) -> list[str]:
        out = []
        for e in self.events:
            if e.op != "read_page" or e.outcome != "ok":
                continue
            ordinal, page = e.detail
            draft = self.drafts[ordinal]
            if page.offset != draft.offset or list(page.rows) != [
                Occurrence(normalize(o.data), o.source_identity) for o in draft.rows
            ]:
                out.append(f"{e.actor}: read_page({ordinal}) returned rows that are not the source's")
        return out

