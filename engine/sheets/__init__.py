"""Sheets: one table per (play, table namespace) holding each row's inputs and outputs.

Admission (`admit`) puts rows in under the run's write version (its epoch) and tells which need
running; completion (`complete`) writes outcomes back, fenced so a stale run or a superseded
attempt never overwrites newer results; counters (`summary`) always equal a COUNT over the
sheet; `append_rows` and `replace_rows` are the write modes besides admission's upsert
(`writes`); a map records the rows its run reused (`record_reuse`, `reuse`). See the modules
for how each part works.
"""

from .admission import admit
from .probing import probe
from .audit import ErrorCount, ErrorCounts, FailedRow, RunRows, error_counts, failed_rows, run_rows
from .completion import complete
from .dataset import Dataset, count, dataset, field_kinds, read_page
from .dataset_pages import DatasetPage, PageCursor
from .ensure import ensure_sheet
from .layout import SheetLayout
from .model import (
    Admission,
    AdmittedRow,
    Attempt,
    BlockedRow,
    CellPolicy,
    ColumnSummary,
    Completion,
    CompletionDiagnostics,
    FencedRow,
    OutcomeStatus,
    RowOutcome,
    RowStatus,
    SheetContract,
    StagedPage,
    Summary,
    Timing,
)
from .inputs import row_key
from .list_opening import ListMapOpening, open_list_map
from .reading import read_rows, summaries, summary
from .reuse import record_reuse
from .sheet_write import SheetWrite
from .writes import append_rows, replace_rows

__all__ = [
    "SheetContract", "Attempt", "CellPolicy", "row_key", "ensure_sheet", "admit", "Admission",
    "AdmittedRow", "BlockedRow", "RowOutcome", "complete", "Completion", "FencedRow",
    "CompletionDiagnostics", "read_rows", "summary", "summaries", "Summary", "ColumnSummary", "Timing",
    "SheetLayout", "failed_rows", "error_counts", "run_rows", "FailedRow", "ErrorCount",
    "ErrorCounts", "RunRows", "probe", "StagedPage", "append_rows", "replace_rows",
    "record_reuse", "RowStatus", "OutcomeStatus", "SheetWrite", "open_list_map", "ListMapOpening",
    "dataset", "Dataset", "read_page", "count", "field_kinds", "DatasetPage", "PageCursor",
]
