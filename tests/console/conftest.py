"""One real cluster (etcd, 3 bookies with their /metrics, a Kafka listener with its group-lag /metrics),
one ``scroll console`` process against it and one headless Debian chromium driven by selenium,
shared by the console tests of a session. ``SCROLL_CONSOLE_SCREENSHOTS=DIR`` saves each page shown."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from streams.tools.localcluster import LocalCluster, free_port
from tests.kafka.conftest import ShimThread

ROOT = Path(__file__).resolve().parents[2]


def wait_for(cond, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


class ConsoleProc:
    """``python -m compat_kafka.console ...`` (as ``scroll standalone`` starts it), stopped at the end."""

    def __init__(self, tmp: Path, metadata_url: str, args: list[str], scheme: str = "http"):
        self.port = free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log = tmp / f"console-{self.port}.log"
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "SCROLL_METADATA": metadata_url}
        with open(self.log, "wb") as out:
            self.popen = subprocess.Popen([sys.executable, "-m", "compat_kafka.console", "--port", str(self.port),
                                           *args], stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, context=None) -> None:
        def up():
            if self.popen.poll() is not None:
                raise AssertionError(f"the console exited: {self.log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(self.url + "/healthz", timeout=2, context=context)
                return True
            except (OSError, urllib.error.URLError):
                return False

        wait_for(up, 60, "the console to answer")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


@pytest.fixture(scope="session")
def console_cluster(tmp_path_factory):
    bookie_metrics = [free_port() for _ in range(3)]
    c = LocalCluster(tmp_path_factory.mktemp("console-cluster"), bookies=3, bookie_metrics_ports=bookie_metrics)
    c.start()
    shim = metrics = None
    try:
        shim = ShimThread(c.metadata_url, free_port())
        shim.start()
        from compat_kafka.cli.metrics import ListenerMetrics

        metrics = ListenerMetrics(shim.bootstrap)
        metrics_port = free_port()
        metrics.serve(metrics_port)
        c.console_sources = [f"kafka=http://127.0.0.1:{metrics_port}/metrics"] + [
            f"bookie-{i}=http://127.0.0.1:{p}/metrics" for i, p in enumerate(bookie_metrics)]
        c.shim = shim
        yield c
    finally:
        if metrics is not None:
            metrics.close()
        if shim is not None:
            shim.stop()
        c.stop()


@pytest.fixture(scope="session")
def console(console_cluster, tmp_path_factory):
    args = ["--bootstrap", console_cluster.shim.bootstrap, "--sample-interval", "0.5"]
    for s in console_cluster.console_sources:
        args += ["--metrics", s]
    p = ConsoleProc(tmp_path_factory.mktemp("console"), console_cluster.metadata_url, args)
    try:
        p.wait_ready()
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="session")
def browser(tmp_path_factory):
    d = _driver_with(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    try:
        d.set_page_load_timeout(30)
        yield d
    finally:
        with contextlib.suppress(Exception):
            d.quit()


def _driver_with(extra: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    driver_path = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    if not (os.path.exists(chromium) and os.path.exists(driver_path)):
        pytest.fail("Debian's chromium and chromium-driver are needed (scripts/setup.sh installs them)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--disable-dev-shm-usage", "--window-size=1400,1000", "--ignore-certificate-errors", extra):
        opts.add_argument(a)
    return webdriver.Chrome(options=opts, service=Service(driver_path))


def screenshot(browser, name: str) -> None:
    d = os.environ.get("SCROLL_CONSOLE_SCREENSHOTS")
    if d:
        Path(d).mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(Path(d) / f"{name}.png"))
