"""Limits: the bounds a caller is held to, checked before anything is written.

The seam: a limit here depends on nothing but the value or the key it bounds, never on a
session, a sheet or a run.
- `inputs`: what the API accepts: identifier, schema-name and key sizes (pure).
- `bounds`: "a number, not a bool, within bounds", the one numeric check (pure).
- `rates`: shared rate limits, token buckets in the tenant database leased in batches (an
  action: every process sharing a key sees one bucket).
The budgets of database sessions (how many live sessions, what one may carry, their timeouts)
are counted over session roles, so they live with the sessions, `engine.sessions.limits`.
Who may call: anything in runplane. `inputs` and `bounds` import only `engine.errors`, so the
values (`engine.values`) can use them; `rates` sits above the ports and the action registry.
Import the modules; this file re-exports nothing (the values import `inputs` while `rates`
imports the codecs, so a re-export here would close an import cycle).
"""
