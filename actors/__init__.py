"""runplane's actors: runs as trio nurseries of actors, and the embedded supervisor."""

from .progress import MapProgress, MapResult
from .run import Run, open_run
from .supervisor import Supervisor, open_supervisor


def __getattr__(name: str):
    # The sealer needs engine.array_input; import it on first use of its public name.
    if name == "StagedArray":
        from .sealer import StagedArray

        return StagedArray
    raise AttributeError(f"module 'actors' has no attribute {name!r}")


__all__ = [
    "open_run", "Run", "MapResult", "MapProgress", "StagedArray", "open_supervisor", "Supervisor",
]
