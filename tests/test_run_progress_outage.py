"""`runplane run`'s bars while its run waits for the database: a row "waiting for the database
(N s)" while the run's `OutageWatch` says it waits (kept by `retry_transient`, as a run's store
calls keep it), hidden once the database answers again. (The log form, a progress line, is
checked end to end with a server stopped under `runplane run`: `tests/test_outages.py`.)"""

from __future__ import annotations

import io

import trio

from runplane.actors.retry import OutageWatch, retry_transient
from runplane.cli.progress import RunProgress
from runplane.engine.errors import StoreUnavailableError


async def until(predicate) -> None:
    with trio.fail_after(10):
        while not predicate():
            await trio.sleep(0.01)


async def shown_while(waiting: bool) -> str:
    """The bars' last frame, drawn while a store call waits for the database (`waiting`) or
    after it came back."""
    watch = OutageWatch(60.0)
    back = trio.Event()

    async def call() -> str:
        if not back.is_set():
            raise StoreUnavailableError("the database is away")
        return "answered"

    stream = io.StringIO()
    with RunProgress(stream=stream, live=True, outage=watch) as progress:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: retry_transient(call, watch=watch))
            await until(lambda: watch.waiting_s() is not None)
            progress.show_waiting()
            if not waiting:
                back.set()
                await until(lambda: watch.waiting_s() is None)
                progress.show_waiting()
            back.set()
    return stream.getvalue()


async def test_the_bars_show_a_row_while_the_run_waits_for_the_database():
    frame = await shown_while(waiting=True)
    assert "waiting for the database (0 s)" in frame, frame
    assert "the outage budget is 60 s" in frame, frame


async def test_the_row_is_hidden_once_the_database_answers_again():
    frame = await shown_while(waiting=False)
    assert "waiting for the database" not in frame, frame
