"""The play file of `benchmarks/scale.py`: its functions are found by workers by name."""

PLAY = "bench-scale"


def _burn(n: int) -> int:
    total = 0
    for i in range(44_000):  # about 2 ms of pure-Python work on this machine
        total += (i * i + n) % 7
    return total


async def burn(row):
    """CPU-bound: holds the process's one core for about 2 ms."""
    return {"burn": _burn(row["n"])}


async def noop(row):
    return {"ok": 1}
