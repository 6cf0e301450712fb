"""A real headless Chromium for the page's tests (Debian's chromium and chromium-driver, driven
by selenium): `open_browser` (conftest.py's ``browser`` fixture) and two helpers."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def open_browser(profile: Path):
    """A Chromium driver with its profile in ``profile``; skips the test where there is none."""
    if not (Path(CHROMIUM).is_file() and Path(CHROMEDRIVER).is_file()):
        pytest.skip(
            f"no headless browser here ({CHROMIUM}, {CHROMEDRIVER}): "
            "apt-get install chromium chromium-driver (.ci/run does)"
        )
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={profile}", "--window-size=1280,900"]:
        options.add_argument(flag)
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager: never look online
    return webdriver.Chrome(
        options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER)
    )


def wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


FILL = """
const [field, value] = arguments;
field.value = value;
field.dispatchEvent(new Event("input", { bubbles: true }));
field.dispatchEvent(new Event("change", { bubbles: true }));
"""


def fill(driver, element_id: str, value: str) -> None:
    """Set a field at once, with the ``input`` and ``change`` events typing and leaving it send.

    One script, not ``clear()`` then ``send_keys``: ``clear()`` sends no ``input`` event, so a
    timer of the page's (the debounced sizing of Max tokens after the prompt was typed) could
    write into the emptied field before the keys came ("62" then "5" made "625"); and
    ChromeDriver's keys cannot carry a character outside the BMP (an emoji)."""
    driver.execute_script(FILL, driver.find_element("id", element_id), value)
