"""Shared maps, the engine's side: one map's units handed out as leases to many worker
processes, and the writes those workers make under their leases (docs/guide/scaling-out.md).

What is where
- `maps`: publishing a map and its units, its state (waiting, open, done, cancelled), the
  workers that joined it, and its status (the counters every unit's holders recorded).
- `leases`: claims, renewals, releases, the settled mask of each unit, and `lease_check`,
  the check that guards every write of a claimed unit.
- `units`: a worker's writes, a claim's rows admitted and completed in the transaction that
  checks and settles its leases.
Each operation is an action (`engine.actions`), so a worker behind a gateway runs exactly as one
with a DSN. Who may call: the actors' shared-map code (`actors.shared`), the console and the
command line (status, workers); `engine.sheets.completion` reads `maps` to fence a write without
an attempt. Import the modules (`from runplane.engine.shared import maps`); this file re-exports
nothing.
"""
