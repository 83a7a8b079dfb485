"""`python -m runplane.simulations NAME [--examples N] [--seed S]` — run a race simulation.

Each scenario is a module `simulations.<name>` exposing `run(examples: int, seed: int | None,
dsn: str | None = None) -> SimulationReport`. With no DSN it uses `RUNPLANE_TEST_DSN`, then the
embedded server. Exits 1 when any invariant was violated.
"""

from __future__ import annotations

import argparse
import sys

from . import SCENARIOS, run_scenario


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runplane.simulations", description=__doc__.splitlines()[0])
    parser.add_argument("name", nargs="?", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument("--examples", type=int, default=None,
                        help="examples per scenario (default: the scenario's, else 100)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dsn", default=None, help="PostgreSQL DSN (default: RUNPLANE_TEST_DSN or embedded)")
    args = parser.parse_args(argv)
    names = list(SCENARIOS) if args.name == "all" else [args.name]
    failed = False
    for name in names:
        report = run_scenario(name, examples=args.examples, seed=args.seed, dsn=args.dsn)
        print(report.summary())
        for violation in report.violations:
            print(f"  violation: {violation}")
        failed |= not report.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
