"""The web console in a real browser (headless Debian chromium) against a real cluster: pages render
with real data, the fragment chain names the bookies that hold the stream, the record browser
shows a record kcat wrote, a group's lag rises and falls, bad input gets a clear message."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from selenium.webdriver.common.by import By

from compat_kafka.groups.group_admin import KafkaAdmin
from streams.client import connect

from .conftest import screenshot, wait_for

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]


def run(coro):
    return asyncio.run(coro)


def text(browser, css: str) -> str:
    """The text of the element (waiting for it: a form's answer may still be loading)."""
    return wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, css), 15, css)[0].text


def submit(browser, form) -> None:
    """Submit and wait for the answer to replace the page."""
    old = browser.find_element(By.TAG_NAME, "html")
    form.find_element(By.TAG_NAME, "button").click()
    wait_for(lambda: _stale(old), 15, "the form's answer")


def _stale(el) -> bool:
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

    try:
        el.tag_name  # noqa: B018
        return False
    except StaleElementReferenceException:
        return True
    except WebDriverException as exc:  # chromium may say so in its own words while the page is replaced
        if "does not belong to the document" in str(exc):
            return True
        raise


def kcat(bootstrap: str, topic: str, lines: str, *args: str) -> None:
    subprocess.run(["kcat", "-b", bootstrap, "-t", topic, "-P", *args], input=lines.encode(), check=True, timeout=60)


def test_stream_page_draws_the_fragment_chain_with_its_bookies(console, console_cluster, browser):
    async def write():
        c = await connect(console_cluster.metadata_url)
        try:
            await c.create_stream("chain-demo", ensemble=3, write_quorum=2, ack_quorum=2, fragment_entries_max=2)
            for writer in range(2):  # the second writer takes the stream over (a new term); 2 entries a fragment
                async with await c.producer("chain-demo") as p:
                    for i in range(5):
                        await p.append(f"record {writer}-{i}".encode())
            info = await c.describe_stream("chain-demo")
            return [(f.index, set(f.ensemble)) for f in info.fragments], sum(f.size_bytes or 0 for f in info.fragments)
        finally:
            await c.close()

    frags, sealed_bytes = run(write())
    browser.get(console.url + "/streams/chain-demo")
    for index, ensemble in frags:
        box = browser.find_element(By.ID, f"frag-{index}")
        shown = {a.text.split()[0] for a in box.find_elements(By.CSS_SELECTOR, "a.bookie")}
        assert shown == ensemble
    assert len(frags) >= 2 and "10 records" in text(browser, "main")
    assert "take-over" in text(browser, "#history")
    # its bytes graph: sampled from the stream's fragment records once its page was shown (the
    # console never reads standalone's per-stream gauge; this cluster has no standalone at all)
    assert sealed_bytes > 0

    def sampled():
        with urllib.request.urlopen(console.url + "/api/series?s=value:stream_bytes:chain-demo", timeout=5) as r:
            values = [v for v in json.load(r)["value:stream_bytes:chain-demo"]["v"] if v is not None]
        return values and values[-1] == sealed_bytes

    wait_for(sampled, 20, "the stream's bytes sampled")
    screenshot(browser, "stream")


def test_stream_list_searches_and_paginates(console, console_cluster, browser):
    async def create():
        c = await connect(console_cluster.metadata_url)
        try:
            await c.create_topic("paged-topic", partitions=5)
        finally:
            await c.close()

    run(create())
    browser.get(console.url + "/streams?q=paged-topic&size=2")
    names = [r.text.split()[0] for r in browser.find_elements(By.CSS_SELECTOR, "#streams tr")[1:]]
    assert names == ["paged-topic", "paged-topic:1"]
    assert "5 streams" in text(browser, "main")
    old = browser.find_element(By.TAG_NAME, "html")
    browser.find_element(By.ID, "next").click()
    wait_for(lambda: _stale(old), 15, "the next page")
    names = [r.text.split()[0] for r in browser.find_elements(By.CSS_SELECTOR, "#streams tr")[1:]]
    assert names == ["paged-topic:2", "paged-topic:3"]
    screenshot(browser, "streams")
    # records/s in: from two views of the row (kept 5 s between readings), nothing sampled meanwhile
    kcat(console_cluster.shim.bootstrap, "paged-topic", "a\nb\nc\n", "-p", "2")

    def rate_shown():
        browser.get(console.url + "/streams?q=paged-topic:2")
        cells = browser.find_elements(By.CSS_SELECTOR, "#streams tr td")
        return cells and cells[6].text not in ("-", "0.0") and float(cells[6].text) > 0

    wait_for(rate_shown, 30, "records/s in of paged-topic:2")
    # records/s out: a consumer group's committed progress on the partition, between two readings
    kcat(console_cluster.shim.bootstrap, "paged-topic", "".join(f"r{i}\n" for i in range(120)), "-p", "2")
    started = time.monotonic()

    async def commit_more():  # the group reads a record a second
        async with KafkaAdmin(console_cluster.shim.bootstrap) as a:
            await a.commit("paging-readers", {("paged-topic", 2): 1 + int(time.monotonic() - started)})

    def out_shown():
        run(commit_more())
        browser.get(console.url + "/streams?q=paged-topic:2")
        cells = browser.find_elements(By.CSS_SELECTOR, "#streams tr td")
        return cells and cells[7].text not in ("-", "0.0") and float(cells[7].text) > 0

    wait_for(out_shown, 60, "records/s out of paged-topic:2")
    browser.get(console.url + "/streams?page=nope")
    assert "page must be a whole number" in text(browser, "#error")


def test_record_browser_shows_a_record_written_by_kcat(console, console_cluster, browser):
    kcat(console_cluster.shim.bootstrap, "kcat-records", 'user-7:{"sku": 7, "qty": 2}\n', "-K:", "-H", "source=web")
    kcat(console_cluster.shim.bootstrap, "kcat-records", "plain text\n")
    browser.get(console.url + "/records?topic=kcat-records&partition=0&offset=0&limit=10")
    rows = browser.find_elements(By.CSS_SELECTOR, "#records tr")[1:]
    assert len(rows) == 2
    first = rows[0].text
    assert "user-7" in first and "source=web" in first
    assert '"sku": 7' in rows[0].find_element(By.CSS_SELECTOR, "pre.json").text  # pretty-printed JSON
    assert "plain text" in rows[1].text
    screenshot(browser, "records")
    # the live tail: a record written after the page opened appears without reloading
    browser.get(console.url + "/records?stream=kcat-records&mode=tail&limit=10")
    kcat(console_cluster.shim.bootstrap, "kcat-records", "written later\n")
    wait_for(lambda: "written later" in text(browser, "#records"), 20, "the tail to show the new record")
    # a page size over the bound is refused with a clear message, nothing read
    browser.get(console.url + "/records?stream=kcat-records&limit=100000")
    assert "page size must be in 1..500" in text(browser, "#error")


def test_group_lag_rises_and_falls(console, console_cluster, browser):
    bootstrap = console_cluster.shim.bootstrap
    kcat(bootstrap, "lagging", "".join(f"m{i}\n" for i in range(4)))

    async def commit(offset):
        async with KafkaAdmin(bootstrap) as a:
            await a.commit("lag-group", {("lagging", 0): offset})

    run(commit(1))
    browser.get(console.url + "/groups/lag-group")
    assert text(browser, "#total-lag") == "3"
    kcat(bootstrap, "lagging", "m4\nm5\n")
    browser.refresh()
    assert text(browser, "#total-lag") == "5"  # it rose
    # the lag graph fills from the listener's /metrics, sampled by the console
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".chart.drawn"), 30, "the lag graph")
    screenshot(browser, "group")
    # a reset needs the group's name typed as confirmation
    form = browser.find_element(By.ID, "reset")
    form.find_element(By.NAME, "to").send_keys("latest")
    form.find_element(By.NAME, "confirm").send_keys("wrong")
    submit(browser, form)
    assert "type the group's name" in text(browser, "#message"), text(browser, "main")
    assert text(browser, "#total-lag") == "5"
    form = browser.find_element(By.ID, "reset")
    form.find_element(By.NAME, "to").send_keys("latest")
    form.find_element(By.NAME, "confirm").send_keys("lag-group")
    submit(browser, form)
    assert "offsets reset" in text(browser, "#message"), text(browser, "main")
    assert text(browser, "#total-lag") == "0"  # and fell
    browser.get(console.url + "/groups")
    assert "lag-group" in text(browser, "#groups")


def test_bookie_page_lists_its_fragments_and_metrics(console, console_cluster, browser):
    browser.get(console.url + "/bookies")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#bookies tr")) == 4
    screenshot(browser, "bookies")
    browser.get(console.url + "/bookies/bookie-0")
    frags = text(browser, "#fragments")
    assert "chain-demo" in frags or "kcat-records" in frags
    wait_for(lambda: "adds" in (browser.refresh() or text(browser, "#metrics")), 20, "the bookie's metrics")
    screenshot(browser, "bookie")


def test_unknown_stream_is_a_clear_error(console, browser):
    browser.get(console.url + "/streams/" + urllib.parse.quote("no-such-stream"))
    assert "no stream named 'no-such-stream'" in text(browser, "#error")


def test_overview_shows_bookies_listener_and_says_loopback_only(console, console_cluster, browser):
    """(Last: its screenshot shows the streams and groups the other tests made.)"""
    browser.get(console.url + "/")
    rows = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#bookies tr")[1:], 10, "bookie rows")
    assert {r.text.split()[0] for r in rows} == {"bookie-0", "bookie-1", "bookie-2"}
    assert all(" up " in f" {r.text} " for r in rows)
    assert f"127.0.0.1:{console_cluster.shim.port}" in text(browser, "#listeners")
    assert console_cluster.metadata_url.rsplit(":", 1)[1] in text(browser, "#etcd")  # etcd's member list
    assert "loopback only" in text(browser, "#insecure")
    # the graphs are drawn from the console's own samples of the bookies' /metrics
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".chart.drawn"), 30, "a drawn graph")
    screenshot(browser, "overview")
