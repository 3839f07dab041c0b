"""The chat page in a real browser (Debian's chromium + chromium-driver, driven by selenium) against a
live server on the tiny Llama with an API key: the key is asked once, tokens stream into the page,
Stop aborts the request and the engine stops generating (its metrics), the curl view shows the
request, and the page fits a phone's width. Screenshots go to `.cache/artifacts/chat-page/`.

`nox -s tests` installs chromium and chromium-driver with apt-get when they are missing; where no
browser can be had, the test is skipped with that reason (shown by `-rs`).
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from conformance.live import free_port, serve
from opentgi.config import Settings
from tests.helpers import tiny_models

pytestmark = pytest.mark.slow  # a real browser process (Debian's chromium) driving the page

ARTIFACTS = Path(__file__).resolve().parents[1] / ".cache" / "artifacts" / "chat-page"
KEY = "browser-test-key"
DECODE_STEPS = 'tgi_batch_inference_count{method="decode"}'
MAX_TOKENS = 3000  # far more than the page lets through before Stop is pressed
CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1100,800"]


def _browser_paths() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        pytest.skip("no browser: Debian's chromium and chromium-driver are not installed "
                    "(`apt-get install chromium chromium-driver`; `nox -s tests` tries that itself)")
    return browser, driver


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = _browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    profile = tempfile.mkdtemp(prefix="opentgi-chromium-")
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def server():
    settings = Settings(model_id=str(tiny_models.tiny_llama_path()), device="cpu", hostname="127.0.0.1",
                        port=free_port(), api_key=KEY, max_input_tokens=512, max_total_tokens=4096,
                        max_batch_total_tokens=8192)
    with serve(settings, startup_timeout_s=120) as url:
        yield url


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _wait(condition, timeout_s: float, what: str, shown=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}" + (f"; {shown()}" if shown else ""))


def _state(driver, server: str, reply) -> str:
    """What a failed wait reports: the reply's text, whether the page holds the key, and the engine's
    decode steps and failed requests, so a flaky run says which side stalled."""
    key_kept = driver.execute_script(f"return sessionStorage.getItem('opentgi-api-key') === '{KEY}'")
    metrics = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    engine = [line for line in metrics.splitlines()
              if line.startswith((DECODE_STEPS, "tgi_request_failure", "tgi_batch_current_size"))]
    return f"the reply ends {reply.text[-300:]!r}, key kept: {key_kept}, engine: {engine}"


def _set(driver, element_id: str, value: str) -> None:
    field = driver.find_element("id", element_id)
    field.clear()
    field.send_keys(value)


def test_chat_page_streams_stops_and_fits_a_phone(browser, server):
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.wait import WebDriverWait

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.set_window_size(1100, 800)
    browser.get(f"{server}/")
    assert browser.title == "opentgi chat"
    _set(browser, "temperature", "1")
    _set(browser, "max-tokens", str(MAX_TOKENS))
    steps_before = _metric(server, DECODE_STEPS)

    browser.find_element("id", "input").send_keys("Tell me a long story.", Keys.ENTER)
    alert = WebDriverWait(browser, 20).until(expected_conditions.alert_is_present())  # the 401
    assert "API key" in alert.text
    alert.send_keys(KEY)
    alert.accept()

    reply = browser.find_elements("css selector", ".msg.assistant")[-1]
    shown = lambda: _state(browser, server, reply)  # noqa: E731
    first = _wait(lambda: reply.text, 30, "streamed text", shown)
    _wait(lambda: len(reply.text) > len(first), 30, "more streamed text", shown)
    assert "streaming" in reply.get_attribute("class")  # still generating when Stop is pressed
    browser.find_element("id", "stop").click()
    _wait(lambda: "(stopped)" in reply.text, 10, "the reply marked as stopped")

    # The engine stopped: its batch empties and its decode steps stop, well short of the token budget.
    _wait(lambda: _metric(server, "tgi_batch_current_size") == 0, 10, "an empty batch")
    steps = _metric(server, DECODE_STEPS) - steps_before
    time.sleep(1.0)
    assert _metric(server, DECODE_STEPS) - steps_before == steps
    assert 0 < steps < MAX_TOKENS, steps
    print(f"decode steps before Stop took effect: {steps:.0f}")
    load = httpx.get(f"{server}/token_load", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert load["current_load"] == 0  # no KV held for a running request
    browser.save_screenshot(str(ARTIFACTS / "desktop-stopped.png"))

    # A second turn: the key is kept for the session (no second prompt) and the reply completes.
    _set(browser, "max-tokens", "12")
    browser.find_element("id", "input").send_keys("Thanks!", Keys.ENTER)
    second = _wait(lambda: browser.find_elements("css selector", ".msg.assistant")[1:], 10, "a second reply")[-1]
    _wait(lambda: "streaming" not in second.get_attribute("class"), 60, "the second reply to finish")
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text
    assert second.text and "error" not in second.get_attribute("class"), second.text

    browser.find_element("css selector", "#curl-box summary").click()
    curl = browser.find_element("id", "curl").text
    assert curl.startswith(f"curl -N '{server}/v1/chat/completions'")
    assert 'Authorization: Bearer $API_KEY' in curl and KEY not in curl
    assert '"max_tokens":12' in curl and '"stream":true' in curl and "Tell me a long story." in curl
    browser.save_screenshot(str(ARTIFACTS / "desktop.png"))

    info = httpx.get(f"{server}/info", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert browser.find_element("id", "model").text == info["model_id"]  # read once the key was given

    browser.find_element("css selector", "#curl-box summary").click()  # closed again
    browser.set_window_size(390, 844)  # a phone's width
    overflow = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the page is {overflow}px wider than a phone's screen"
    browser.save_screenshot(str(ARTIFACTS / "phone.png"))

    browser.find_element("id", "new-chat").click()
    assert browser.find_elements("css selector", ".msg") == []
    print(f"screenshots: {ARTIFACTS}")
