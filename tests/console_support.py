"""Shared set-up for the console tests: two orgs' runs in one schema, and logged-in clients."""

from __future__ import annotations

import contextlib
import re

import attrs
import httpx

from runplane.actors import open_run
from runplane.engine import open_tenant, sheets

from .gateway_support import SECRET

CONTRACT = sheets.SheetContract(inputs=("name",), outputs=("upper",))
OTHER_ORG = "org-other"
EVIL = "<script>alert('x')</script>"
OTHER_SECRET = "OTHER-ORG-SECRET-VALUE"


async def upper(row: dict) -> dict:
    if row["name"].startswith("bad"):
        raise ValueError(f"no data for {row['name']} {EVIL}")
    return {"upper": row["name"].upper()}


@attrs.frozen
class Seeded:
    alpha_run: str
    beta_run: str
    other_run: str


async def seed(tenant) -> Seeded:
    """org-test: play `alpha` (table `t`: 60 good rows, 3 failing, one holding `EVIL`) and play
    `beta`; org-other: play `alpha` holding `OTHER_SECRET`."""
    rows = [{"name": EVIL}] + [{"name": f"r{i:03d}"} for i in range(60)] + [
        {"name": f"bad{i}"} for i in range(3)]
    async with open_run(tenant, "alpha") as run:
        await run.map("t", rows, upper, contract=CONTRACT)
        alpha = run.run_id
    async with open_run(tenant, "beta") as run:
        await run.map("u", [{"name": "beta-row"}], upper, contract=CONTRACT)
        beta = run.run_id
    async with open_tenant(OTHER_ORG, tenant.dsn, schema=tenant.schema) as other:
        async with open_run(other, "alpha") as run:
            await run.map("t", [{"name": OTHER_SECRET}], upper, contract=CONTRACT)
            other_run = run.run_id
    return Seeded(alpha, beta, other_run)


@contextlib.asynccontextmanager
async def client(url: str):
    async with httpx.AsyncClient(base_url=url, follow_redirects=False, trust_env=False,
                                 timeout=30) as http:
        yield http


async def login_token(http: httpx.AsyncClient, token: str) -> httpx.Response:
    """Log in as a browser does from the console's own login page (`Origin`: the console)."""
    origin = str(http.base_url).rstrip("/")
    return await http.post("/ui/login", data={"token": token}, headers={"origin": origin})


def cookie_header(response: httpx.Response) -> str:
    return response.headers.get("set-cookie", "")


def run_ids(text: str) -> set[str]:
    return set(re.findall(r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}", text))


__all__ = ["SECRET", "seed", "client", "login_token", "Seeded", "OTHER_ORG", "EVIL",
           "OTHER_SECRET", "CONTRACT", "upper", "cookie_header", "run_ids"]
