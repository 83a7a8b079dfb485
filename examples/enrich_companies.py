"""An example play: enrich a few companies, durably and idempotently.

    runplane run examples/enrich_companies.py --input examples/companies.csv
    runplane status enrich-companies

`runplane run` opens a run of the play named `PLAY` and calls `play(run, rows)` with the input
rows (CSV columns or JSON-lines objects). `run.map` stages the rows, admits them into the sheet
`companies`, calls `enrich` on every row that has no stored result yet (at most `concurrency` at a
time), and stores each row's outputs. Run it twice: the second run finds every row cached. A row
whose function raises is stored as failed with the message, and retried by the next run.
"""

import trio

from runplane.engine.sheets import SheetContract

PLAY = "enrich-companies"

CONTRACT = SheetContract(
    inputs=("name", "domain", "country"),
    outputs=("tld", "name_length", "region"),
)

REGIONS = {"US": "americas", "CA": "americas", "BR": "americas", "DE": "emea", "FR": "emea",
           "GB": "emea", "JP": "apac", "IN": "apac"}


async def enrich(row: dict) -> dict:
    await trio.sleep(0.01)  # stands in for a call to an enrichment API
    if not row.get("domain"):
        raise ValueError(f"{row['name']} has no domain")
    return {
        "tld": row["domain"].rsplit(".", 1)[-1],
        "name_length": len(row["name"]),
        "region": REGIONS.get(row.get("country", ""), "unknown"),
    }


async def play(run, rows):
    return await run.map("companies", rows, enrich, contract=CONTRACT, concurrency=8)
