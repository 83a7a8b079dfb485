"""runplane's actors: runs as trio nurseries of actors, and the embedded supervisor."""

from .executors import DaskExecutor, ProcessExecutor
from .map_options import MapOptions
from .policies import RateLimit, RowRetry
from .progress import MapProgress, MapResult
from .row_functions import RowError
from .run import Run, open_run
from .sealer import StagedArray
from .supervisor import Supervisor, open_supervisor

__all__ = [
    "open_run", "Run", "MapResult", "MapProgress", "StagedArray", "open_supervisor", "Supervisor",
    "RowRetry", "RateLimit", "ProcessExecutor", "DaskExecutor", "MapOptions",
    "RowError",
]
