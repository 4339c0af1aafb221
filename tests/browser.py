"""Headless Debian Chromium through selenium, offline, for the report's browser tests."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-quic", "--window-size=1280,1000"]
# Runs before any page script: dialogs are recorded instead of shown.
RECORD_DIALOGS = """
window.__dialogs = [];
for (const name of ["alert", "confirm", "prompt", "print"]) {
  window[name] = function (...args) { window.__dialogs.push([name, String(args[0])]); };
}
"""


@contextmanager
def chromium(user_data_dir: Path) -> Iterator[Any]:
    """A headless Chromium with the network off and dialogs recorded in ``window.__dialogs``."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.skip(f"{', '.join(missing)} missing: install Debian's chromium and chromium-driver "
                    "(scripts/test.sh does when run as root)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in [*FLAGS, f"--user-data-dir={user_data_dir}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SE_OFFLINE", "true")  # with both paths given Selenium Manager has nothing to fetch anyway
        driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    try:
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.emulateNetworkConditions", {
            "offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1})
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": RECORD_DIALOGS})
        yield driver
    finally:
        driver.quit()


def open_page(driver: Any, path: Path, plots: int, timeout: float = 60) -> None:
    """Load ``path`` and scroll each of its plots into view (the page draws a plot as it comes near the view)
    until ``plots`` plotly figures have drawn their SVG; then back to the top."""
    driver.get_log("browser")  # drop what earlier pages logged
    driver.get(path.resolve().as_uri())
    deadline = time.monotonic() + timeout
    for k in range(driver.execute_script("return document.querySelectorAll('div.plot').length")):
        driver.execute_script("document.querySelectorAll('div.plot')[arguments[0]].scrollIntoView()", k)
        while not driver.execute_script("return !!document.querySelectorAll('div.plot')[arguments[0]]"
                                        ".querySelector('.main-svg')", k):
            assert time.monotonic() < deadline, f"plot {k} did not render in {timeout} s"
            time.sleep(0.05)
    driver.execute_script("window.scrollTo(0, 0)")
    assert driver.execute_script("return document.querySelectorAll('.js-plotly-plot .main-svg').length") >= plots


def console_errors(driver: Any) -> list[dict[str, Any]]:
    """The console entries at level SEVERE since the last call."""
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]

