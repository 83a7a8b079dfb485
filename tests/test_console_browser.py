"""The console in a real browser (playwright driving Debian's chromium): log in, watch a running
map's counts rise without a reload, open a failing row's error, another org sees none of it,
values are shown as text. Every page visited is saved as a screenshot under the test's tmp dir."""

from __future__ import annotations

import asyncio
import re

import pytest

from .browser_support import chromium_path, serve_in_background
from .console_support import EVIL, OTHER_SECRET

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def world(dsn):
    chromium = chromium_path()
    live, stop = serve_in_background(dsn)
    try:
        yield chromium, live
    finally:
        stop()


@pytest.fixture(scope="module")
def browser(world):
    from playwright.sync_api import sync_playwright

    chromium, _ = world
    # trio-asyncio (imported by the engine) installs its event loop policy; playwright's
    # synchronous API needs a plain asyncio loop of its own on this thread.
    policy = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
    try:
        with sync_playwright() as driver:
            browser = driver.chromium.launch(executable_path=chromium,
                                             args=["--no-sandbox", "--disable-gpu"])
            try:
                yield browser
            finally:
                browser.close()
    finally:
        asyncio.set_event_loop_policy(policy)


def logged_in(browser, url: str, token: str):
    context = browser.new_context(viewport={"width": 1300, "height": 900})
    page = context.new_page()
    page.dialogs = []
    page.on("dialog", lambda dialog: (page.dialogs.append(dialog.message), dialog.dismiss()))
    page.violations = []  # the Content-Security-Policy refusing anything the pages use
    page.on("console", lambda message: page.violations.append(message.text)
            if "Content Security Policy" in message.text else None)
    page.goto(url + "/ui/")
    assert page.url.endswith("/ui/login")
    page.fill("textarea[name=token]", token)
    page.click("button[type=submit]")
    page.wait_for_url(url + "/ui/")
    return context, page


def test_log_in_and_see_the_runs(world, browser, tmp_path):
    _, live = world
    context, page = logged_in(browser, live.url, live.token)
    try:
        text = page.inner_text("#runs")
        assert live.alpha_run in text and live.live_run in text
        assert live.other_run not in page.content()
        cookies = context.cookies()
        assert [(c["httpOnly"], c["sameSite"]) for c in cookies] == [(True, "Strict")]
        page.screenshot(path=str(tmp_path / "runs.png"), full_page=True)
        page.select_option("select[name=play]", "alpha")
        page.click("form.filters button")
        assert "play=alpha" in page.url
        assert live.live_run not in page.inner_text("#runs")
    finally:
        context.close()


def test_a_running_maps_counts_rise_without_a_reload(world, browser, tmp_path):
    _, live = world
    context, page = logged_in(browser, live.url, live.token)
    try:
        page.click(f"text={live.live_run}")
        page.wait_for_url(re.compile(r"/ui/runs/live/"))
        page.evaluate("window.__notReloaded = true")
        completed = page.locator('section[data-map="t"] [data-field="completed"]')
        first = int(completed.inner_text())
        page.wait_for_function(
            """([first]) => {
                const el = document.querySelector('section[data-map="t"] [data-field="completed"]');
                return el && parseInt(el.textContent, 10) > first + 20;
            }""", arg=[first], timeout=30_000)
        assert page.evaluate("window.__notReloaded") is True
        # the rate is drawn from successive samples: wait for one taken while rows completed
        page.wait_for_function(
            "() => parseFloat(document.querySelector("
            "'section[data-map=\"t\"] [data-field=\"rate\"]').textContent) > 0",
            timeout=15_000)
        width = page.get_attribute('section[data-map="t"] rect[data-seg="completed"]', "width")
        assert float(width) > 0  # this run's bar
        shown = page.inner_text("main")  # row states read the same words as everywhere
        assert "enriched" not in shown and "pending" not in shown and "This run" in shown
        page.wait_for_function(  # three samples drawn: the chart has a line
            "() => document.querySelector('svg.chart polyline').getAttribute('points')"
            ".split(' ').length >= 3", timeout=15_000)
        page.screenshot(path=str(tmp_path / "run.png"), full_page=True)
        assert page.violations == []
    finally:
        context.close()


def test_open_a_failing_rows_error_and_values_stay_text(world, browser, tmp_path):
    _, live = world
    context, page = logged_in(browser, live.url, live.token)
    try:
        page.goto(f"{live.url}/ui/runs/alpha/{live.alpha_run}")
        page.screenshot(path=str(tmp_path / "finished-run.png"), full_page=True)
        page.click('section[data-map="t"] >> text=failures')
        page.wait_for_url(re.compile(r"/ui/failures/alpha/t"))
        error = page.locator("#failures details").first
        assert not error.locator("pre").is_visible()
        error.locator("summary").click()
        assert "no data for bad0" in error.locator("pre").inner_text()
        assert EVIL in error.locator("pre").inner_text()  # shown as text, never run
        page.screenshot(path=str(tmp_path / "failures.png"), full_page=True)
        page.click("text=all rows")
        page.wait_for_url(re.compile(r"/ui/tables/alpha/t"))
        assert EVIL in page.inner_text("#rows")
        assert page.evaluate("document.querySelectorAll('main script').length") == 0
        page.screenshot(path=str(tmp_path / "table.png"), full_page=True)
        page.click("#next")
        assert "after=" in page.url and "r050" in page.inner_text("#rows")
        assert page.dialogs == [] and page.violations == []
    finally:
        context.close()


def test_another_orgs_token_sees_none_of_it(world, browser, tmp_path):
    _, live = world
    context, page = logged_in(browser, live.url, live.other_token)
    try:
        text = page.inner_text("main")
        assert live.other_run in text
        assert live.alpha_run not in text and live.live_run not in text
        page.screenshot(path=str(tmp_path / "other-org-runs.png"), full_page=True)
        for path in (f"/ui/runs/alpha/{live.alpha_run}", f"/ui/runs/live/{live.live_run}",
                     "/ui/tables/live/t", "/ui/failures/alpha/t?org=org-test"):
            response = page.goto(live.url + path)
            body = page.inner_text("main")
            assert response.status in (200, 404), path
            assert live.alpha_run not in body and "live-0" not in body and "bad0" not in body
        page.goto(f"{live.url}/ui/tables/alpha/t")
        assert OTHER_SECRET in page.inner_text("#rows")
        assert "r001" not in page.content()
        page.click("text=Log out")
        page.wait_for_url(re.compile(r"/ui/login"))
        page.goto(live.url + "/ui/")
        assert page.url.endswith("/ui/login")
    finally:
        context.close()


def test_the_console_commands_one_time_link_logs_in_once(world, browser, tmp_path):
    _, live = world
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(live.console_link)
        assert page.url.endswith("/ui/")
        text = page.inner_text("#runs")  # every org, with an org column
        assert live.alpha_run in text and live.other_run in text and "org-other" in text
        page.screenshot(path=str(tmp_path / "console-runs.png"), full_page=True)
        page.click(f"text={live.other_run}")
        page.wait_for_url(re.compile(r"org=org-other"))
        assert "org-other" in page.inner_text("main")
    finally:
        context.close()
    again = browser.new_context()
    try:
        page = again.new_page()
        response = page.goto(live.console_link)
        assert response.status == 401 and "already used" in page.inner_text("main")
        page.goto(live.console_link.split("/ui/")[0] + "/ui/")
        assert page.url.endswith("/ui/login")
    finally:
        again.close()


def test_a_login_auto_submitted_from_another_site_is_refused(world, browser, tmp_path):
    _, live = world
    context = browser.new_context()
    forged = (f'<form id="f" method="post" action="{live.url}/ui/login">'
              f'<input name="token" value="{live.other_token}"></form>'
              '<script>document.getElementById("f").submit()</script>')
    context.route("http://attacker.example/**",
                  lambda route: route.fulfill(body=forged, content_type="text/html"))
    try:
        page = context.new_page()
        with page.expect_response(f"{live.url}/ui/login") as answer:
            page.goto("http://attacker.example/")
        assert answer.value.status == 403
        page.screenshot(path=str(tmp_path / "forged-login.png"), full_page=True)
        assert [c for c in context.cookies() if c["name"] == "runplane_console"] == []
        page.goto(live.url + "/ui/")
        assert page.url.endswith("/ui/login")  # the victim's browser holds no attacker session
    finally:
        context.close()
