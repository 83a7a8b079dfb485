"""A play file for the shared-map tests: its functions are found by workers by name."""

import os

import trio

PLAY = "scale"


async def tag_pid(row):
    """Each output carries the worker's pid; a short sleep lets several workers take part."""
    await trio.sleep(0.002)
    return {"pid": os.getpid(), "double": row["n"] * 2}


async def meet_tag(row):
    """Like `tag_pid`, but each worker's rows wait (up to 60 s) until two worker processes
    have started rows, so a fast worker cannot take every unit before the other one polls.

    The meeting place is the directory named by `RUNPLANE_TEST_MEET` (each worker leaves a file
    named by its pid); without it the function behaves as `tag_pid`."""
    place = os.environ.get("RUNPLANE_TEST_MEET")
    if place:
        open(os.path.join(place, str(os.getpid())), "a").close()
        with trio.move_on_after(60):
            while len(os.listdir(place)) < 2:
                await trio.sleep(0.01)
    return await tag_pid(row)


async def slow_tag(row):
    """Slow enough that a worker can be killed in the middle of the map."""
    await trio.sleep(0.02)
    return {"pid": os.getpid(), "double": row["n"] * 2}


def burn(row):
    """About 2 ms of pure-Python work (a synchronous function, for process executors)."""
    total = 0
    for i in range(20_000):
        total += i * i % 7
    return {"pid": os.getpid(), "burn": total + row["n"]}


async def noop(row):
    return {"ok": 1}


def die_on_7(row):
    """The pool process running row 7 dies (exit code 3)."""
    if row["n"] == 7:
        os._exit(3)
    return {"pid": os.getpid(), "double": row["n"] * 2}


def hang_on_3(row):
    """Row 3 never returns by itself."""
    if row["n"] == 3:
        import time

        time.sleep(600)
    return {"pid": os.getpid(), "double": row["n"] * 2}


_calls = 0  # calls of `logged_hang` in this process


async def logged_hang(row):
    """Like `slow_tag`, and each call is logged as a line "pid n" in the file named by
    `RUNPLANE_TEST_CALLS` as it starts. The first worker process to start more than
    `RUNPLANE_TEST_HANG_AT` calls becomes the victim (it names itself in `<calls>.victim`): its
    later calls never return, so it is killed with exactly those calls in flight."""
    global _calls
    _calls += 1
    calls = os.environ["RUNPLANE_TEST_CALLS"]
    with open(calls, "a") as log:
        log.write(f"{os.getpid()} {row['n']}\n")
    if _calls > int(os.environ["RUNPLANE_TEST_HANG_AT"]):
        victim = calls + ".victim"
        claim = f"{victim}.{os.getpid()}"
        with open(claim, "w") as mine:
            mine.write(str(os.getpid()))
        try:
            os.link(claim, victim)  # atomic: the first process to get here is the victim
        except FileExistsError:
            pass
        with open(victim) as named:
            if named.read() == str(os.getpid()):
                await trio.sleep_forever()
    return await slow_tag(row)
