"""The dashboard and /docs in a real headless Chromium (Debian's `chromium` and
`chromium-driver`, driven by selenium), with the network off but for this machine.

The page loads with no console error, the heatmap's cells of a layer change after a
request that misses, the request-in-flight panel shows prefill progress during a long
prompt, a wrong key gets a clear message, a foreign Origin (and Host) gets 403, and
/docs renders its operations with nothing from the internet. Screenshots of the page
before and after a request are kept in the run's tmp path (printed with -s).

Without a browser they skip, but under CI=true (.ci/run installs one) they fail.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import threading

import pytest

from dashboard_support import (LONG, dash_server, held_prefill, in_thread, metrics, request,  # noqa: F401
                               wait_until)

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
CHROMEDRIVER = shutil.which("chromedriver")
try:
    import selenium  # noqa: F401
except ImportError:  # pragma: no cover
    selenium = None

MISSING = ", ".join(name for name, found in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER),
                                             ("selenium", selenium)) if not found)
NO_BROWSER = f"no headless Chromium here ({MISSING} missing; Debian: apt-get install chromium chromium-driver)"
IN_CI = os.environ.get("CI", "").lower() in ("true", "1")

pytestmark = pytest.mark.skipif(bool(MISSING) and not IN_CI, reason=NO_BROWSER)

FOREIGN = "evil.example"  # resolved to 127.0.0.1 by the browser: a page on another site


@pytest.fixture(scope="module", autouse=True)
def chromium_in_ci():
    """Under CI=true a missing browser fails these tests (before any server starts)."""
    if MISSING:
        pytest.fail(f"CI=true, and {NO_BROWSER}", pytrace=False)


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
                "--window-size=1400,1100", "--no-first-run", "--disable-extensions", "--lang=en-US",
                # the network is off: every name fails to resolve but this machine's and the foreign test site's
                f"--host-resolver-rules=MAP {FOREIGN} 127.0.0.1,MAP * ~NOTFOUND,EXCLUDE localhost,EXCLUDE 127.0.0.1"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def dash(tmp_path_factory, plugin_checkpoint):
    with dash_server(tmp_path_factory.mktemp("dash-browser") / "llm", plugin_checkpoint) as env:
        yield env


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, plugin_checkpoint):
    with dash_server(tmp_path_factory.mktemp("keyed-browser") / "llm", plugin_checkpoint, api_key="sesame") as env:
        yield env


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    folder = tmp_path_factory.mktemp("screenshots")
    yield folder
    print(f"\nscreenshots: {folder}")


def errors(driver) -> list[dict]:
    """The console's errors since the last call (the log is emptied as it is read)."""
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def open_page(driver, url, frames=2):
    driver.get(url)
    wait_until(lambda: driver.execute_script("return window.mlxsDashboard && window.mlxsDashboard.frames()") >= frames,
               timeout=30)


def chat(env, content, **extra):
    status, _, body = request(env, "POST", "/v1/chat/completions", {
        "model": "mlx-stream", "max_tokens": 6, "messages": [{"role": "user", "content": content}], **extra})
    assert status == 200, body
    return json.loads(body)


def layer_misses(env) -> dict:
    return {x["layer"]: x["misses"] for x in json.loads(request(env, "GET", "/api/stats")[2])["layers"]}


def test_the_page_loads_and_a_layers_cells_change_after_a_request_that_misses(dash, browser, shots):
    errors(browser)
    chat(dash, "hello")  # the model is loaded by the first request
    before_misses = layer_misses(dash)
    open_page(browser, dash.server.url + "/dashboard")
    browser.save_screenshot(str(shots / "dashboard-before.png"))
    before = {i: browser.execute_script(f"return window.mlxsDashboard.rowColours({i})") for i in before_misses}
    assert before and all(len(c) == 8 for c in before.values()), before

    chat(dash, "a prompt the pool has not seen: zebras, quartz and jam")
    missed = [i for i, n in layer_misses(dash).items() if n > before_misses[i]]
    assert missed, "the request should have missed somewhere (4 of 8 slots, a cold pool)"
    layer = missed[0]
    changed = wait_until(lambda: browser.execute_script(f"return window.mlxsDashboard.rowColours({layer})")
                         != before[layer], timeout=10)
    assert changed
    browser.save_screenshot(str(shots / "dashboard-after.png"))
    text = browser.find_element("id", "recent").text
    assert "none yet" not in text  # the response is listed
    rows = browser.find_elements("css selector", "#models tbody tr[data-model]")  # a row per loaded model
    assert len(rows) == 1 and "running" in rows[0].text, [r.text for r in rows]
    assert browser.find_element("id", "live").text == "live"
    assert errors(browser) == []


def test_prefill_progress_shows_in_the_request_in_flight_panel(dash, browser, held_prefill, shots):
    errors(browser)
    open_page(browser, dash.server.url + "/dashboard")
    thread, out = in_thread(chat, dash, LONG, prefill_step=32, max_tokens=2)
    assert held_prefill.entered.wait(60)
    flight = json.loads(request(dash, "GET", "/api/stats")[2])["in_flight"][0]
    shown = f"prefill {flight['prefill_done']:,} / {flight['prefill_total']:,} tokens"  # as the page's en-US locale

    def panel():
        return browser.find_element("id", "flights").text

    wait_until(lambda: shown in panel(), timeout=10, what=lambda: (shown, panel()))
    assert "prefill" in panel() and f"{flight['prompt_tokens']:,} tokens" in panel()
    width = browser.execute_script("return document.querySelector('#flights .progress > div').style.width")
    assert 0 < float(width.rstrip("%")) < 100
    browser.save_screenshot(str(shots / "dashboard-prefill.png"))
    held_prefill.go.set()
    thread.join(60)
    assert "value" in out, out
    wait_until(lambda: "idle" in panel(), timeout=10)
    assert errors(browser) == []


def test_a_wrong_key_gets_a_clear_message_and_the_right_one_connects(keyed, browser):
    browser.get(keyed.server.url + "/dashboard")
    gate = browser.find_element("id", "keygate")
    wait_until(lambda: gate.is_displayed(), timeout=10)
    message = browser.find_element("id", "key-message")
    assert "needs its API key" in message.text
    box = browser.find_element("id", "key-input")
    box.send_keys("not the key")
    browser.find_element("css selector", "#key-form button").click()
    wait_until(lambda: "refused that key" in message.text, timeout=10)
    assert "bad" in message.get_attribute("class") and gate.is_displayed()
    assert browser.execute_script("return window.mlxsDashboard.frames()") == 0
    errors(browser)  # the refused requests' 401s are logged: expected here
    box.send_keys("sesame")
    browser.find_element("css selector", "#key-form button").click()
    wait_until(lambda: browser.execute_script("return window.mlxsDashboard.frames()") >= 1, timeout=10)
    assert not gate.is_displayed()
    # kept in the tab only
    assert browser.execute_script("return sessionStorage.getItem('mlxs-api-key')") == "sesame"
    assert browser.execute_script("return localStorage.length") == 0
    browser.execute_script("sessionStorage.clear()")


class _Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = b"<!doctype html><title>another site</title><p>another site</p>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_foreign_origin_or_host_gets_403(dash, browser):
    # a request with a foreign Origin, as a browser sends it
    for path in ("/dashboard", "/dashboard/events"):
        status, _, body = request(dash, "GET", path, headers={"Origin": f"http://{FOREIGN}"})
        assert status == 403 and json.loads(body)["error"]["code"] == "origin_not_allowed"
    # a page of another site fetching the event stream: refused before any frame
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    try:
        before = metrics(dash)
        browser.get(f"http://{FOREIGN}:{site.server_address[1]}/")
        result = browser.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            f"fetch('http://127.0.0.1:{dash.server.port}/dashboard/events').then(r => done('read ' + r.status),"
            " e => done('failed: ' + e.name));")
        assert result.startswith("failed")  # no CORS for a foreign origin: the page reads nothing
        key = ("mlxs_http_requests_total", (("api", "dashboard"), ("status", "403")))
        assert metrics(dash).get(key, 0) == before.get(key, 0) + 1  # the server answered 403
    finally:
        site.shutdown()
        site.server_close()
    # the dashboard asked for by a foreign name (DNS rebinding): 403 too
    browser.get(f"http://{FOREIGN}:{dash.server.port}/dashboard")
    assert "host_not_allowed" in browser.find_element("tag name", "body").text
    errors(browser)


def test_docs_render_their_operations_with_the_network_off(dash, browser, shots):
    errors(browser)
    browser.get(dash.server.url + "/docs")
    count = wait_until(lambda: browser.execute_script("return document.querySelectorAll('.opblock').length"),
                       timeout=30)
    assert count >= 10
    text = browser.find_element("tag name", "body").text
    assert "/v1/chat/completions" in text and "/metrics" in text
    browser.save_screenshot(str(shots / "docs.png"))
    assert errors(browser) == []
