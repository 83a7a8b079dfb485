"""A play file whose play name is computed, as a user's may be (`os.environ.get(...)`)."""

import os

import trio

PLAY = os.environ.get("RUNPLANE_TEST_COMPUTED_PLAY", "computed-" + "name")


async def double(row):
    await trio.sleep(0)
    return {"double": row["n"] * 2}


async def play(run, rows):
    await run.map("nums", rows, double)


GATE = None  # a trio.Event a test sets: `gated` calls wait for it


async def gated(row):
    if GATE is not None:
        await GATE.wait()
    return {"double": row["n"] * 2}
