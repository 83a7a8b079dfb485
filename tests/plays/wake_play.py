"""A play whose map runs on local workers (`runplane run ... --workers N`), for the test that
kills its coordinator and wakes it."""

import os

import trio

from runplane.engine.sheets import SheetContract

PLAY = "scale-wake"
CONTRACT = SheetContract(("n",), ("pid", "double"))


async def slow(row):
    await trio.sleep(0.01)
    return {"pid": os.getpid(), "double": row["n"] * 2}


async def play(run, rows):
    return await run.map("nums", [{"n": i} for i in range(3000)], slow, contract=CONTRACT,
                         concurrency=4)
