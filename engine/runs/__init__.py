"""Runs: the run registry and what is kept about each run besides its sheets and receipts.

What is where
- `registry`: runs and their fencing epochs (`register`, `get`, `by_epoch`, `list_runs`,
  `record_command`, `new_run_id`); its names are `engine.runs`' public names
  (docs/guide/python-api.md), so import them from `engine.runs`.
- `outbox`: the terminal outbox, leased to-do entries for retiring finished runs.
- `history`: run history, what each map of each run did (`run_maps`).
- `row_calls`: rows in a call, what "running" means on every surface (`row_calls`).
- `cancel`: a run asked to stop (`request_cancel`, `cancel_requested`, `CancelAnswer`).
- `reissue`: re-issuing a statement until the row it decides on is visible; every
  insert-if-absent-else-read statement goes through it (`engine.receipts`, `registry`, the
  array-input facts).
Work receipts, fenced by these runs' epochs, stay `engine.receipts` (a public module path,
docs/guide/python-api.md). Who may call: the actors, the gateway's actions, the console and the
command line; these modules import only the engine's root modules and `engine.values` / `engine.limits`.
"""

from .registry import RunInfo, by_epoch, get, list_runs, new_run_id, record_command, register

__all__ = ["register", "get", "by_epoch", "list_runs", "record_command", "new_run_id", "RunInfo"]
