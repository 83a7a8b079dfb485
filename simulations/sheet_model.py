"""A pure model of sheet fencing: what a history of admissions and completions allows.

How it works
- Scenarios record every call that returned (a call that raised had no effect: each is one
  transaction, and the fault-injecting port never faults COMMIT) with what it sent and what it
  got back. Every completed outcome carries a value unique to its call, so the stored row says
  which call wrote it.
- `SheetHistory.check(stored)` judges the final sheet against the history:
    * ownership: a row exists exactly for the keys some call took (an admission that listed it
      as pending, or a completion that committed it), and its write version is the highest
      version that took it;
    * provenance: a terminal row's outputs (or error) were written by a committed outcome of its
      own write version, by an attempt compatible with the attempt holding the row;
    * fences: no fenced outcome's value is stored anywhere; every fence reason agrees with the
      write version it reports; a call's committed and fenced keys partition its unique keys;
    * dispositions: an admission's pending, completed and blocked rows partition its unique
      keys; a row blocked as `newer_run` was taken by a newer version at some point, and one
      blocked as `attempt_active` was leased by another attempt of the same version.
This module does no I/O.
"""

from __future__ import annotations

import attrs

from runplane.engine.canonical import JsonValue
from runplane.engine.sheets.model import BLOCK_REASONS, OutcomeStatus, RowStatus


@attrs.frozen
class StoredRow:
    key: str
    status: str
    write_version: int
    attempt_id: str | None
    value: JsonValue  # the `score` output cell
    error: str | None


@attrs.frozen
class AdmitCall:
    actor: str
    epoch: int
    attempt_id: str | None
    keys: tuple[str, ...]          # unique keys sent, in order
    pending: tuple[str, ...]
    completed: tuple[str, ...]
    blocked: tuple[tuple[str, str], ...]


@attrs.frozen
class SentOutcome:
    key: str
    status: str
    value: str  # unique per call and key: the score (completed) or the error (failed)


@attrs.frozen
class CompleteCall:
    actor: str
    epoch: int
    attempt_id: str | None
    outcomes: tuple[SentOutcome, ...]
    committed: tuple[str, ...]
    fenced: tuple[tuple[str, str, int | None], ...]


@attrs.define(eq=False)
class SheetHistory:
    admissions: list[AdmitCall] = attrs.field(factory=list)
    completions: list[CompleteCall] = attrs.field(factory=list)

    def check(self, stored: dict[str, StoredRow]) -> list[str]:
        out: list[str] = []
        takers: dict[str, set[int]] = {}
        for call in self.admissions:
            out += _check_admission(call)
            for key in call.pending:
                takers.setdefault(key, set()).add(call.epoch)
        written: dict[str, list[tuple[CompleteCall, SentOutcome]]] = {}
        fenced_values: dict[str, set[str]] = {}
        for call in self.completions:
            out += _check_completion(call)
            by_key = {o.key: o for o in call.outcomes}
            for key in call.committed:
                takers.setdefault(key, set()).add(call.epoch)
                written.setdefault(key, []).append((call, by_key[key]))
            for key, _reason, _version in call.fenced:
                fenced_values.setdefault(key, set()).add(by_key[key].value)

        leases = {
            (key, call.epoch, call.attempt_id)
            for call in self.admissions if call.attempt_id is not None for key in call.pending
        }
        for call in self.admissions:
            for key, reason in call.blocked:
                if reason == "newer_run" and not any(v > call.epoch for v in takers.get(key, ())):
                    out.append(f"{call.actor}: {key} blocked as newer_run, but no newer version "
                               f"than {call.epoch} ever took it")
                if reason == "attempt_active" and not any(
                    k == key and v == call.epoch and a != call.attempt_id for k, v, a in leases
                ):
                    out.append(f"{call.actor}: {key} blocked as attempt_active, but no other "
                               f"attempt of version {call.epoch} ever leased it")

        for key in sorted(set(takers) | set(stored)):
            row = stored.get(key)
            if row is None:
                out.append(f"row {key}: taken by versions {sorted(takers[key])} but not stored")
                continue
            if key not in takers:
                out.append(f"row {key}: stored (version {row.write_version}) but no call took it")
                continue
            if row.write_version != max(takers[key]):
                out.append(
                    f"row {key}: write version {row.write_version}, but the highest version "
                    f"that took it is {max(takers[key])}"
                )
            shown = row.value if row.status == RowStatus.ENRICHED else row.error
            if shown in fenced_values.get(key, ()):
                out.append(f"row {key}: holds {shown!r}, the value of a fenced outcome")
            if row.status in (RowStatus.ENRICHED, RowStatus.FAILED):
                want = (OutcomeStatus.COMPLETED if row.status == RowStatus.ENRICHED
                        else OutcomeStatus.FAILED)
                writers = [
                    (call, sent) for call, sent in written.get(key, [])
                    if sent.status == want and sent.value == shown
                ]
                if not writers:
                    out.append(f"row {key}: {row.status} with {shown!r}, written by no committed outcome")
                    continue
                call, _ = writers[0]
                if call.epoch != row.write_version:
                    out.append(
                        f"row {key}: {shown!r} was written by version {call.epoch}, "
                        f"but the row belongs to version {row.write_version}"
                    )
                if (call.attempt_id is not None and row.attempt_id is not None
                        and call.attempt_id != row.attempt_id):
                    out.append(
                        f"row {key}: {shown!r} was written by attempt {call.attempt_id}, "
                        f"but attempt {row.attempt_id} holds the row"
                    )
        return out


def _check_admission(call: AdmitCall) -> list[str]:
    out = []
    listed = [*call.pending, *call.completed, *(key for key, _ in call.blocked)]
    if sorted(listed) != sorted(call.keys):
        out.append(f"{call.actor}: admission lists {len(listed)} rows for {len(call.keys)} keys")
    for key, reason in call.blocked:
        if reason not in BLOCK_REASONS:
            out.append(f"{call.actor}: blocked {key} with unknown reason {reason!r}")
    return out


def _check_completion(call: CompleteCall) -> list[str]:
    out = []
    keys = [o.key for o in call.outcomes]
    listed = [*call.committed, *(key for key, _, _ in call.fenced)]
    if sorted(listed) != sorted(keys):
        out.append(f"{call.actor}: committed + fenced do not partition the {len(keys)} keys sent")
    status = {o.key: o.status for o in call.outcomes}
    for key, reason, version in call.fenced:
        ok = {
            "stale_write_version": version is not None and version > call.epoch,
            "unadmitted": version is not None and version < call.epoch,
            "attempt_superseded": version == call.epoch and call.attempt_id is not None,
            "already_completed": version == call.epoch and status.get(key) == OutcomeStatus.FAILED,
            "missing": version is None and status.get(key) == OutcomeStatus.FAILED,
        }.get(reason, False)
        if not ok:
            out.append(
                f"{call.actor}: fenced {key} as {reason} (row version {version}) "
                f"at epoch {call.epoch} for a {status.get(key)} outcome"
            )
    return out
