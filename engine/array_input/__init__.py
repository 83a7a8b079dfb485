"""Array inputs: a map's in-memory source staged as immutable, digest-checked pages.

A woken run replays byte-identical input one page at a time. The flow:
`source_fingerprint` and `paginate` (pure) → `begin` (creates the run guard and the begin fact)
→ `put_page` for every draft (write-once; several tasks may put at once) → `seal` (verifies every
page in bounded batches and writes the seal under the locked guard) → `read_page` (re-verifies
each page's digest) → `retire` (marks the retained run guard retired and deletes the run's
facts at most 128 per call). `get_manifest` says where a map's staging stands.

`encode_source` encodes a whole list source once (fingerprint, page cuts, page facts on demand,
and each row's canonical text; a `PagedRows` source, too large to hold, page by page), and
`put_encoded_page` puts a page it encoded (`source`; its one encoding pass: `source_pass`).
`pages` holds the values and the pure encoding; `facts` the keys, the guard and the
one-statement operations; `sealing` and `retirement` the two multi-step operations. Errors are typed
(`engine.errors`); bad input is refused before any query.
"""

from .facts import begin, get_manifest, put_encoded_page, put_page, read_page
from .values import (
    MAX_PAGE_BYTES, MAX_PAGE_ROWS, RETIRE_BATCH_ROWS, Manifest, Occurrence, Page, PageDraft,
    RetireResult, SourceIdentity,
)
from .pages import paginate, source_fingerprint
from .retirement import retire, retire_entry
from .source import PagedRows, PagedSource, encode_source
from .source_pass import EncodedSource, SourceShape, scan_source
from .sealing import put_and_seal, seal

__all__ = [
    "Occurrence", "SourceIdentity", "PageDraft", "Page", "Manifest", "RetireResult",
    "source_fingerprint", "paginate", "get_manifest", "begin", "put_page", "seal", "read_page",
    "retire", "retire_entry", "put_and_seal", "MAX_PAGE_ROWS", "MAX_PAGE_BYTES", "RETIRE_BATCH_ROWS", "EncodedSource",
    "encode_source", "put_encoded_page", "PagedRows", "PagedSource", "SourceShape",
    "scan_source",
]
