"""Shared maps, the actors' side: one map spread over worker processes (docs/guide/scaling-out.md).

What is where
- `coordinator`: `Run.map(..., workers=N)` / `shared=True`: stage the list, publish the map,
  start local workers, report progress, sum the result. It takes the map's plan and the map
  id its caller decided, never the `Run`.
- `config`: what a published map tells its workers (the contract and row policies as JSON, the
  function by play file, qualified name and digest), and loading the play file in a worker.
- `worker`: `runplane worker`: join a play's shared maps and serve them one after the other.
- `service`: one worker's service of one map (claims, admissions, runners, batches, renewals).
- `work`: what a worker holds of its claims, and one row's run under the map's policies.
Who may call: `actors.run` (the coordinator), `actors.executors` (`config`), the command line
(`runplane worker`, `--workers`) and simulations. These modules import the actors' root modules
and the engine (`engine.shared` for the statements), never `actors.run`. Import the modules;
this file re-exports nothing.
"""
