"""Finding a row and reading it, in a real browser (Debian's chromium): a search by input value
on a table's page opens the row's page; a failed row's page from the failures page; the runs
list kept live by its stream. Screenshots of each page under the test's tmp dir."""

from __future__ import annotations

import re

import pytest

from .console_support import EVIL
from .test_console_browser import browser, logged_in, world  # noqa: F401 - fixtures

pytestmark = pytest.mark.browser


def test_a_search_by_input_value_opens_the_rows_page(world, browser, tmp_path):  # noqa: F811
    _, live = world
    context, page = logged_in(browser, live.url, live.token)
    try:
        page.goto(f"{live.url}/ui/tables/alpha/t")
        page.select_option("#search select[name=field]", "name")
        page.fill("#search input[name=value]", "r042")
        page.screenshot(path=str(tmp_path / "table-search.png"), full_page=True)
        page.click("#search button")
        page.wait_for_url(re.compile(r"/ui/rows/alpha/t/"))
        inputs, outputs = page.inner_text("#inputs"), page.inner_text("#outputs")
        assert "r042" in inputs and "R042" in outputs and "completed" in outputs
        page.click(f"#outputs >> text={live.alpha_run}")
        page.wait_for_url(re.compile(rf"/ui/runs/alpha/{live.alpha_run}"))
        page.go_back()
        page.screenshot(path=str(tmp_path / "row.png"), full_page=True)

        page.goto(f"{live.url}/ui/tables/alpha/t")
        page.fill("#search input[name=value]", "nobody")
        page.click("#search button")
        page.wait_for_url(re.compile(r"/ui/search/alpha/t\?"))
        assert "searched all 64 rows" in page.inner_text("#search-note")
        assert "runplane index alpha t name" in page.inner_text("#search-note")
        page.screenshot(path=str(tmp_path / "search.png"), full_page=True)
        assert page.dialogs == [] and page.violations == []
    finally:
        context.close()


def test_a_failed_rows_page_from_the_failures_page(world, browser, tmp_path):  # noqa: F811
    _, live = world
    context, page = logged_in(browser, live.url, live.token)
    try:
        page.goto(f"{live.url}/ui/failures/alpha/t")
        assert "(3 rows)" not in page.content()
        page.click("#causes a >> nth=0")  # the filter by cause, with its count
        page.wait_for_url(re.compile(r"cause="))
        assert "(3 rows)" in page.inner_text("#cause")
        page.click("#failures a >> nth=0")
        page.wait_for_url(re.compile(r"/ui/rows/alpha/t/"))
        failure = page.inner_text("#failure")
        assert "no data for bad0" in failure and EVIL in failure  # as text
        assert page.evaluate("document.querySelectorAll('main script').length") == 0
        page.screenshot(path=str(tmp_path / "row-failed.png"), full_page=True)
        assert page.dialogs == [] and page.violations == []
    finally:
        context.close()


def test_the_runs_list_is_kept_live(world, browser, tmp_path):  # noqa: F811
    _, live = world
    context, page = logged_in(browser, live.url, live.token)
    try:
        page.evaluate("window.__notReloaded = true")
        page.wait_for_function(
            "() => document.getElementById('runs-list').hasAttribute('data-updated')",
            timeout=15_000)
        assert page.evaluate("window.__notReloaded") is True
        assert live.live_run in page.inner_text("#runs")
        page.select_option("select[name=state]", "done")
        page.click("form.filters button")
        page.wait_for_url(re.compile(r"state=done"))
        page.wait_for_function(
            "() => document.getElementById('runs-list').hasAttribute('data-updated')",
            timeout=15_000)
        text = page.inner_text("#runs")
        assert live.alpha_run in text and live.live_run not in text
        page.screenshot(path=str(tmp_path / "runs-live.png"), full_page=True)
        assert page.violations == []
    finally:
        context.close()
