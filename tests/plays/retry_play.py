"""A play file for the retry tests: a function whose failures and outputs a test switches.

`RUNPLANE_TEST_BROKEN` set: rows whose `n` is a multiple of 3 fail. `RUNPLANE_TEST_FACTOR`
(default 2) is what `n` is multiplied by, so a recompute is seen in the outputs."""

import os

from runplane.engine.sheets import SheetContract

PLAY = "retrying"
CONTRACT = SheetContract(("n",), ("product", "pid"))


async def multiply(row):
    if os.environ.get("RUNPLANE_TEST_BROKEN") and row["n"] % 3 == 0:
        raise ValueError(f"no product for {row['n']}")
    factor = int(os.environ.get("RUNPLANE_TEST_FACTOR", "2"))
    return {"product": row["n"] * factor, "pid": os.getpid()}


async def play(run, rows):
    return await run.map("nums", rows, multiply, contract=CONTRACT)
