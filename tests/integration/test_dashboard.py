"""The dashboard at GET / in a real headless chromium, against real `lbproxy run` processes.

Selenium drives Debian's chromium through Debian's chromedriver (/usr/bin/chromedriver;
nothing is downloaded). `scripts/test` installs both as root; elsewhere these tests skip
and say why. What a person would check: the page shows the API's names and numbers, a
click on "drain" drains the server (asked for the token when the API wants one), the
chart grows, the API's error text is shown on a 400, and a stopped proxy is said to be
unreachable. A 1280x800 screenshot is saved in the test's temporary folder.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import tools
from tests.integration.harness import (
    ROOT,
    Answering,
    Echo,
    ask_name,
    free_port,
    front_door_proxy,
    http,
    open_and_read_name,
    ready,
    vs_config,
    wait_for,
    with_admin,
    worker_servers,
    workers_config,
)

CHROMEDRIVER = "/usr/bin/chromedriver"
TOKEN = "dashboard-token-42"
WIDTH, HEIGHT = 1280, 800


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def browser(tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    chromium = _chromium()
    if chromium is None:
        tools.missing("chromium", "chromium")
    if not os.access(CHROMEDRIVER, os.X_OK):
        tools.missing("chromedriver", "chromium-driver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in (
        "--headless=new",
        "--no-sandbox",  # root in a container has no user namespaces for the sandbox
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={WIDTH},{HEIGHT}",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--no-first-run",
        "--disable-extensions",
    ):
        options.add_argument(argument)
    service = Service(executable_path=CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        # The page's own viewport, exactly 1280x800, whatever the window decorations.
        driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
        )
        driver.set_page_load_timeout(20)
        yield driver
    finally:
        driver.quit()


# -- reading the page as a person reads it ----------------------------------------------


def number(value) -> str:
    """What the page prints for a number (en-US grouping, up to 3 decimals), or "–"."""
    if value is None:
        return "–"
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.3f}".rstrip("0").rstrip(".")


def size(n: int) -> str:
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    value, i = float(n), 0
    while value >= 1024 and i < len(units) - 1:
        value /= 1024
        i += 1
    return f"{n} B" if i == 0 else f"{value:.1f} {units[i]}"


def expected_row(rs: dict) -> dict[str, str]:
    row = {
        "name": rs["name"] + (" backup" if rs.get("backup") else ""),
        "address": rs["address"],
        "state": rs["state"] + agent_text(rs.get("agent")),
        # an ejected server's health cell adds "ejected" and the time left (its own test)
        **({} if rs.get("ejected_until") else {"health": rs["health"]}),
        "w-static": number(rs["weight"]["static"]),
        "w-dynamic": number(rs["weight"]["dynamic"]),
        "w-effective": number(rs["weight"]["effective"]),
        "active": number(rs["active_connections"]),
        "total": number(rs["connections_total"]),
        "bytes-in": size(rs["bytes_in"]),
        "bytes-out": size(rs["bytes_out"]),
    }
    if rs.get("load") is not None:
        row["load"] = number(rs["load"])
    if rs.get("snmp"):
        row["snmp-value"] = number(rs["snmp"]["value"])
        row["snmp-result"] = rs["snmp"]["result"] or "not yet"
    return row


def agent_text(agent: dict | None) -> str:
    """What the page shows of a server's agent beside its state ("" when it says ready
    at 100%)."""
    if not agent:
        return ""
    said = [] if agent["state"] == "ready" else [agent["state"]]
    if agent["weight_percent"] != 100:
        said.append(f"{agent['weight_percent']}%")
    if agent["max_connections"] is not None:
        said.append(f"maxconn {agent['max_connections']}")
    return f" agent {' '.join(said)}" if said else ""


def read_page(read):
    """`read()` of elements the page may replace between finding one and reading it (it
    re-renders on each refresh): read again, at once, from the new ones (bounded)."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(20):
        try:
            return read()
        except StaleElementReferenceException:
            continue
    return read()


def shown_row(driver, vs: str, rs: str, cells) -> dict[str, str]:
    def read() -> dict[str, str]:
        row = _row(driver, vs, rs)
        return {cell: row.find_element("css selector", f".{cell}").text.strip() for cell in cells}

    return read_page(read)


def _row(driver, vs: str, rs: str):
    return driver.find_element("css selector", f'tr.rs[data-vs="{vs}"][data-rs="{rs}"]')


def api(admin_port: int) -> dict:
    status, body = http("GET", f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers")
    assert status == 200, body
    return json.loads(body)


def page_matches_api(driver, admin_port: int) -> bool | list:
    """True when every real server of the API's document is shown with its numbers."""
    mismatches = []
    for vs in api(admin_port)["virtual_servers"]:
        section = driver.find_element("css selector", f'section.vs[data-vs="{vs["name"]}"]')
        head = section.find_element("css selector", ".vs-head").text
        queued = f"queued {number(vs['queued'])}"
        for word in (vs["name"], vs["scheduler"], vs["throttle_mode"], *vs["listen"], queued):
            if word not in head:
                mismatches.append((vs["name"], word, head))
        for rs in vs["real_servers"]:
            want = expected_row(rs)
            got = shown_row(driver, vs["name"], rs["name"], want)
            if got != want:
                mismatches.append((vs["name"], rs["name"], want, got))
    if mismatches:
        return mismatches  # shown by wait_until when it times out
    return True


def chart_points(driver, vs: str, rs: str) -> int:
    svg = _row(driver, vs, rs).find_element("css selector", "td.chart svg")
    return int(svg.get_attribute("data-points"))


def wait_until(condition, timeout: float = 15.0, what: str = "condition"):
    """wait_for, for the page: an exception (the page is still building: the element is
    not there yet) or a list (mismatches) is not there yet, and is shown at the timeout."""
    last = None

    def met():
        nonlocal last
        try:
            last = condition()
        except Exception as exc:
            last = exc
        return last if last is True or (last and not isinstance(last, list | Exception)) else None

    return wait_for(met, timeout, what, interval=0.1, details=lambda: repr(last))


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def state_of(admin_port: int, vs: str, rs: str) -> str:
    url = f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers/{vs}/real-servers/{rs}"
    status, body = http("GET", url)
    assert status == 200, body
    return json.loads(body)["state"]


def hold(port: int, count: int, payload: bytes = b"") -> list:
    """`count` held connections through the proxy, each sending `payload` (echoed)."""
    held = []
    for _ in range(count):
        sock, _ = open_and_read_name(port)
        if payload:
            sock.sendall(payload)
            echoed = b""
            while len(echoed) < len(payload):
                echoed += sock.recv(65536)
        held.append(sock)
    return held


# -- the tests ---------------------------------------------------------------------------


def test_dashboard_one_process(browser, name_servers, lbproxy, tmp_path):
    servers = name_servers("alpha", "bravo", "charlie")
    port, api_port, admin_port = free_port(), free_port(), free_port()
    token_file = tmp_path / "admin.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    config = with_admin(
        vs_config(port, servers, "rr", "health_check: {type: none}"), admin_port, token_file
    )
    # A second virtual server: least-load fed by SNMP (its load and SNMP columns; no
    # agent listens, so the last poll is an error and the static weight is used), with
    # one real server that nobody answers, so its row is shown down.
    config += (
        "  - name: api\n"
        f"    listen: 127.0.0.1:{api_port}\n"
        "    scheduler: least-load\n"
        "    load_source: snmp\n"
        f"    snmp: {{port: {free_port()}, interval: 1s, timeout: 200ms, retries: 0,"
        " on_no_answer: static}\n"
        "    health_check: {type: tcp, interval: 250ms, timeout: 250ms, rise: 1, fall: 1}\n"
        "    real_servers:\n"
        f"      - {{name: bravo, address: 127.0.0.1:{servers[1].port}, max_connections: 10}}\n"
        f"      - {{name: gone, address: 127.0.0.1:{free_port()}, max_connections: 10}}\n"
    )
    proxy = lbproxy(config, [port, api_port])
    held = hold(port, 3, b"x" * 3000) + hold(port, 2) + hold(api_port, 3)
    try:
        # down, and checked: a held client refused by it can mark it down (a passive
        # failure) before its first active check has run
        wait_for(
            lambda: {rs["name"]: (rs["health"], rs["check"] is not None) for rs in api(
                admin_port)["virtual_servers"][1]["real_servers"]}
            == {"bravo": ("up", True), "gone": ("down", True)},
            what="gone to be down, after an active check",
        )  # fmt: skip
        browser.get(f"http://127.0.0.1:{admin_port}/")
        assert browser.title == "lbproxy"
        wait_until(lambda: page_matches_api(browser, admin_port), what="the page to match the API")
        # the Content-Security-Policy lets it run and blocks nothing it does
        problems = [e["message"] for e in browser.get_log("browser") if "ecurity" in e["message"]]
        assert problems == [], problems
        document = api(admin_port)
        web = {rs["name"]: rs for rs in document["virtual_servers"][0]["real_servers"]}
        assert sorted(rs["active_connections"] for rs in web.values()) == [1, 2, 2]
        assert web["alpha"]["bytes_in"] == 3000  # rr: the first three each sent 3000 bytes
        assert shown_row(browser, "web", "alpha", ["bytes-in"]) == {"bytes-in": "2.9 KiB"}
        loads = {rs["name"]: rs["load"] for rs in document["virtual_servers"][1]["real_servers"]}
        assert loads["bravo"] >= 0.3  # least-load: 3 of 10 connections, or more estimated
        assert shown_row(browser, "api", "bravo", ["load"]) == {"load": number(loads["bravo"])}
        assert "down" in _row(browser, "api", "gone").get_attribute("class")
        pill = _row(browser, "api", "gone").find_element("css selector", "td.health .pill")
        assert pill.get_attribute("title") == "tcp check: connection refused"
        wait_until(
            lambda: (
                [rs["snmp"] for rs in api(admin_port)["virtual_servers"][1]["real_servers"]]
                == [{"value": None, "result": "error"}] * 2
            ),  # port unreachable: no agent there
            what="a failed SNMP poll",
        )
        wait_until(
            lambda: (
                shown_row(browser, "api", "bravo", ["snmp-value", "snmp-result"])
                == {"snmp-value": "–", "snmp-result": "error"}
            ),
            what="the SNMP columns",
        )
        wait_until(  # the refresh re-renders the element: read it until it shows
            lambda: browser.find_element("css selector", "#total-active").text == "8",
            what="8 active connections",
        )

        # The chart gains a point at every refresh (every 2 s).
        points = chart_points(browser, "web", "alpha")
        wait_until(lambda: chart_points(browser, "web", "alpha") >= points + 2, what="points")

        # Drain alpha: the API answers 401, the page asks for the token, then drains.
        assert not browser.find_element("css selector", "#token-dialog").get_attribute("open")
        _row(browser, "web", "alpha").find_element("css selector", "button.set-drain").click()
        wait_until(
            lambda: browser.find_element("css selector", "#token-dialog").get_attribute("open"),
            what="the token dialog",
        )
        # A wrong token first: refused (403), forgotten, asked for again.
        browser.find_element("css selector", "#token-input").send_keys("not-the-token")
        browser.find_element("css selector", "#token-ok").click()
        wait_until(
            lambda: "refused" in browser.find_element("css selector", "#token-why").text,
            what="the token asked for again",
        )
        assert browser.find_element("css selector", "#token-dialog").get_attribute("open")
        assert state_of(admin_port, "web", "alpha") == "enabled"
        browser.find_element("css selector", "#token-input").send_keys(TOKEN)
        browser.find_element("css selector", "#token-ok").click()
        wait_until(lambda: state_of(admin_port, "web", "alpha") == "drain", what="drain")
        wait_until(
            lambda: "drain" in _row(browser, "web", "alpha").get_attribute("class"),
            what="the row to show drain",
        )
        assert "alpha" not in {ask_name(port) for _ in range(6)}
        # The token is kept for the next change, in this tab's memory only.
        _row(browser, "web", "alpha").find_element("css selector", "button.set-enabled").click()
        wait_until(lambda: state_of(admin_port, "web", "alpha") == "enabled", what="enable")
        assert not browser.find_element("css selector", "#token-dialog").get_attribute("open")
        stored = browser.execute_script(
            "return [localStorage.length, sessionStorage.length, document.cookie]"
        )
        assert stored == [0, 0, ""]

        # A bad weight: the API's own error text is shown, nothing changes.
        row = _row(browser, "web", "bravo")
        row.find_element("css selector", "input.weight").send_keys("-1")
        row.find_element("css selector", "button.set-weight").click()
        # what the API itself answers to that body
        url = f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers/web/real-servers/bravo"
        status, body = http("PATCH", url, {"weight": -1}, token=TOKEN)
        assert status == 400
        message = json.loads(body)["error"]
        assert message.startswith("weight must be") and "-1" in message
        wait_until(
            lambda: (
                _row(browser, "web", "bravo").find_element("css selector", ".message").text
                == message
            ),
            what="the error text",
        )
        assert message in browser.find_element("css selector", "#notice-text").text
        assert api(admin_port)["virtual_servers"][0]["real_servers"][1]["weight"]["static"] == 1
        # And a good one.
        row.find_element("css selector", "input.weight").clear()
        row.find_element("css selector", "input.weight").send_keys("3")
        row.find_element("css selector", "button.set-weight").click()
        wait_until(
            lambda: shown_row(browser, "web", "bravo", ["w-static"]) == {"w-static": "3"},
            what="weight 3 shown",
        )
        wait_until(lambda: page_matches_api(browser, admin_port), what="the page to match")

        shot = tmp_path / "dashboard.png"
        browser.save_screenshot(str(shot))
        assert png_size(shot) == (WIDTH, HEIGHT)
    finally:
        for sock in held:
            sock.close()

    # The proxy stops: the page says the API is unreachable and keeps the last data.
    proxy.signal(signal.SIGTERM)
    assert proxy.proc.wait(15) == 0
    wait_until(
        lambda: browser.find_element("css selector", "#banner").is_displayed(),
        what="the unreachable banner",
    )
    banner = browser.find_element("css selector", "#banner").text
    assert "The admin API is unreachable" in banner and "Showing what was read at" in banner
    assert _row(browser, "web", "alpha").is_displayed()
    browser.save_screenshot(str(tmp_path / "dashboard-unreachable.png"))


def test_dashboard_with_two_workers(browser, name_servers, lbproxy, tmp_path):
    servers = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    token_file = tmp_path / "admin.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    config = workers_config(port, servers, admin_port)
    proxy = lbproxy(config.replace("admin: {", f"admin: {{token_file: {token_file}, ", 1))
    wait_for(lambda: ready(admin_port), what="/readyz")
    held = hold(port, 6, b"hello")
    try:
        browser.get(f"http://127.0.0.1:{admin_port}/")
        wait_until(lambda: page_matches_api(browser, admin_port), what="the page to match")
        # The supervisor's merged document: all six held connections, from both workers.
        wait_until(  # the refresh re-renders the element: read it until it shows
            lambda: browser.find_element("css selector", "#total-active").text == "6",
            what="6 active connections",
        )
        wait_until(
            lambda: browser.find_element("css selector", "#workers-summary").text == "2/2",
            what="the workers line",
        )
        points = chart_points(browser, "web", "b")
        # The supervisor asks for the token as one process does (a change over TCP needs
        # it); the PATCH reaches every worker.
        _row(browser, "web", "b").find_element("css selector", "button.set-drain").click()
        wait_until(
            lambda: browser.find_element("css selector", "#token-dialog").get_attribute("open"),
            what="the token dialog",
        )
        browser.find_element("css selector", "#token-input").send_keys(TOKEN)
        browser.find_element("css selector", "#token-ok").click()
        wait_until(lambda: state_of(admin_port, "web", "b") == "drain", what="drain")
        for index in (1, 2):
            assert worker_servers(admin_port, index)["b"]["state"] == "drain"
        assert not browser.find_element("css selector", "#token-dialog").get_attribute("open")
        wait_until(lambda: chart_points(browser, "web", "b") >= points + 2, what="points")
        wait_until(lambda: page_matches_api(browser, admin_port), what="the page to match")
        browser.save_screenshot(str(tmp_path / "dashboard-workers.png"))
    finally:
        for sock in held:
            sock.close()
    proxy.signal(signal.SIGTERM)
    assert proxy.proc.wait(15) == 0


def test_dashboard_without_a_token_file_is_read_only_and_says_where_changes_go(
    browser, name_servers, lbproxy
):
    """No token_file: over TCP the endpoint is read-only (SPEC §21). The page shows
    everything; a button's change is refused, and the row and the notice say why and
    where to change instead (the admin socket); no token is asked for, nothing changes."""
    servers = name_servers("a", "b")
    port, admin_port = free_port(), free_port()
    lbproxy(with_admin(vs_config(port, servers, "rr", "health_check: {type: none}"), admin_port))
    browser.get(f"http://127.0.0.1:{admin_port}/")
    wait_until(lambda: page_matches_api(browser, admin_port), what="the page to match")
    _row(browser, "web", "a").find_element("css selector", "button.set-drain").click()
    wait_until(
        lambda: (
            "read-only over TCP"
            in _row(browser, "web", "a").find_element("css selector", ".message").text
        ),
        what="the refusal beside the row",
    )
    message = _row(browser, "web", "a").find_element("css selector", ".message").text
    assert "token_file" in message and f"admin-{admin_port}.sock" in message, message
    notice = browser.find_element("css selector", "#notice-text").text
    assert "refused (HTTP 403)" in notice and "read-only over TCP" in notice, notice
    assert not browser.find_element("css selector", "#token-dialog").get_attribute("open")
    assert state_of(admin_port, "web", "a") == "enabled"


def test_dashboard_asks_for_the_token_to_read_with_read_token(
    browser, name_servers, lbproxy, tmp_path
):
    """`read_token: true`: the API answers reads 401 without the token; the page asks
    for it once and then shows the servers."""
    servers = name_servers("a")
    port, admin_port = free_port(), free_port()
    token_file = tmp_path / "admin.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    config = with_admin(vs_config(port, servers, "rr"), admin_port, token_file)
    lbproxy(config.replace("admin: {", "admin: {read_token: true, ", 1))
    browser.get(f"http://127.0.0.1:{admin_port}/")
    wait_until(
        lambda: browser.find_element("css selector", "#token-dialog").get_attribute("open"),
        what="the token dialog",
    )
    assert "read_token" in browser.find_element("css selector", "#token-why").text
    browser.find_element("css selector", "#token-input").send_keys(TOKEN)
    browser.find_element("css selector", "#token-ok").click()
    wait_until(lambda: _row(browser, "web", "a").is_displayed(), what="the row of a")
    assert not browser.find_element("css selector", "#banner").is_displayed()


def test_dashboard_shows_the_backup_mark_and_the_queued_clients(browser, name_servers, lbproxy):
    """A `backup: true` server and a `queue:` block, with two clients really waiting."""
    _, admin_port, opened = front_door_proxy(name_servers, lbproxy, queued=2)
    try:
        (vs,) = api(admin_port)["virtual_servers"]
        assert vs["queued"] == 2
        browser.get(f"http://127.0.0.1:{admin_port}/")
        wait_until(lambda: page_matches_api(browser, admin_port), what="the page to match")
        queued = 'section.vs[data-vs="web"] .vs-head .vs-queued'
        assert browser.find_element("css selector", queued).text == "2"
        marks = {
            rs: [m.text for m in _row(browser, "web", rs).find_elements("css selector", ".backup")]
            for rs in ("primary", "standby")
        }
        assert marks == {"primary": [], "standby": ["backup"]}
        # The holder leaves: the first waiting client takes its slot, one still waits.
        opened.pop(0).close()
        wait_until(lambda: api(admin_port)["virtual_servers"][0]["queued"] == 1, what="1 queued")
        wait_until(
            lambda: browser.find_element("css selector", queued).text == "1",
            what="the page to show 1 queued",
        )
        wait_until(lambda: page_matches_api(browser, admin_port), what="the page to match")
        problems = [e["message"] for e in browser.get_log("browser") if "ecurity" in e["message"]]
        assert problems == [], problems
    finally:
        for sock in opened:
            sock.close()


def test_dashboard_shows_a_udp_virtual_servers_sessions_datagrams_and_drops(browser, lbproxy):
    """A `protocol: udp` virtual server: the `udp` pill, sessions opened, datagrams in
    and out, drops (by reason in the title), and the real servers' active sessions."""
    servers = {"a": Echo(b"a:"), "b": Echo(b"b:")}
    port, admin_port = free_port(), free_port()
    config = (
        f"global:\n  admin: {{listen: 127.0.0.1:{admin_port}}}\n  drain_timeout: 1s\n"
        "virtual_servers:\n  - name: game\n    protocol: udp\n"
        f"    listen: 127.0.0.1:{port}\n    scheduler: rr\n    deny: [127.0.0.9/32]\n"
        "    real_servers:\n"
        + "".join(
            f"      - {{name: {rs}, address: 127.0.0.1:{echo.port}}}\n"
            for rs, echo in servers.items()
        )
    )
    lbproxy(config)
    clients = []
    for source in ("127.0.0.1", "127.0.0.1", "127.0.0.1", "127.0.0.9"):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((source, 0))
        sock.settimeout(0.5 if source == "127.0.0.9" else 3)
        clients.append(sock)

    def ask(sock) -> bytes | None:
        sock.sendto(b"ping", ("127.0.0.1", port))
        try:
            return sock.recvfrom(100)[0]
        except TimeoutError:
            return None

    def head(cell: str) -> str:
        selector = f'section.vs[data-vs="game"] .vs-head .{cell}'
        return read_page(lambda: browser.find_element("css selector", selector).text)

    try:
        assert [ask(sock) for sock in clients] == [b"a:ping", b"b:ping", b"a:ping", None]
        browser.get(f"http://127.0.0.1:{admin_port}/")
        wait_until(lambda: page_matches_api(browser, admin_port), what="the page to match")
        assert head("udp") == "udp"
        shown = {cell: head(cell) for cell in ("udp-sessions", "udp-in", "udp-out", "udp-dropped")}
        assert shown == {"udp-sessions": "3", "udp-in": "3", "udp-out": "3", "udp-dropped": "1"}
        dropped = 'section.vs[data-vs="game"] .vs-head .udp-dropped'
        title = read_page(
            lambda: (
                browser.find_element("css selector", dropped)
                .find_element("xpath", "..")
                .get_attribute("title")
            )
        )
        assert title == "acl: 1"
        active = {rs: shown_row(browser, "game", rs, ["active"])["active"] for rs in servers}
        assert active == {"a": "2", "b": "1"}  # the real servers' open sessions
        # A datagram on an open session and a new session: the page follows.
        assert ask(clients[0]) == b"a:ping"
        extra = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        extra.settimeout(3)
        clients.append(extra)
        assert ask(extra) == b"b:ping"
        wait_until(lambda: head("udp-sessions") == "4" and head("udp-in") == "5", what="4 and 5")
        wait_until(lambda: page_matches_api(browser, admin_port), what="the page to match")
        problems = [e["message"] for e in browser.get_log("browser") if "ecurity" in e["message"]]
        assert problems == [], problems
    finally:
        for sock in clients:
            sock.close()
        for echo in servers.values():
            echo.close()


def test_dashboard_page_is_served_whole_and_self_contained(name_servers, lbproxy):
    """Without a browser: GET / answers the page, and it loads nothing from elsewhere."""
    servers = name_servers("a")
    port, admin_port = free_port(), free_port()
    lbproxy(with_admin(vs_config(port, servers, "rr", "health_check: {type: none}"), admin_port))
    request = urllib.request.Request(f"http://127.0.0.1:{admin_port}/")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/html; charset=utf-8"
        policy = response.headers["Content-Security-Policy"]
        assert response.headers["X-Frame-Options"] == "DENY"
        page = response.read().decode()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    # no external asset: no <link>, no <script src>, no src/href/url() pointing anywhere
    assert "<link" not in page
    assert not re.search(r"""<script[^>]*\bsrc=""", page)
    assert not re.search(r"""\b(?:src|href)\s*=\s*["']?(?:https?:)?//""", page)
    assert not re.search(r"""url\(\s*["']?(?:https?:)?//""", page)
    assert "@import" not in page
    # the policy lets the page's own script and style run (by hash), nothing else
    assert "frame-ancestors 'none'" in policy and "connect-src 'self'" in policy
    (script,) = re.findall(r"<script>(.*?)</script>", page, re.S)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}';" in policy
    assert "unsafe-inline" not in policy
    assert http("HEAD", f"http://127.0.0.1:{admin_port}/")[0] == 200
    assert http("POST", f"http://127.0.0.1:{admin_port}/", {})[0] == 405


def test_the_page_is_package_data(tmp_path):
    """`pip install .` (not only an editable install) ships dashboard.html."""
    build = subprocess.run(
        [sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py",
         "--build-lib", str(tmp_path / "lib")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    built = tmp_path / "lib" / "lbproxy" / "admin" / "dashboard.html"
    assert built.read_bytes() == (ROOT / "lbproxy" / "admin" / "dashboard.html").read_bytes()


def test_dashboard_shows_what_the_agent_says_beside_the_state(browser, name_servers, lbproxy):
    """A server whose agent (agent_check) says `50% drain # deploy` shows a pill
    "agent drain 50%" beside its state `enabled`, the reason as its tooltip."""
    from tests.integration.agents import Agent

    a, b = name_servers("a", "b")
    agents = [Agent(b"ready\n"), Agent(b"50% drain # deploy\n")]
    port, admin_port = free_port(), free_port()
    config = with_admin(
        vs_config(
            port,
            [a, b],
            "rr",
            "agent_check: {interval: 100ms}",
            {
                "a": f"agent_check: {{port: {agents[0].port}}}",
                "b": f"agent_check: {{port: {agents[1].port}}}",
            },
        ),
        admin_port,
    )
    try:
        lbproxy(config, wait_ports=[port])
        wait_for(
            lambda: (
                (api(admin_port)["virtual_servers"][0]["real_servers"][1]["agent"] or {}).get(
                    "state"
                )
                == "drain"
            ),
            what="the agent heard",
        )
        browser.get(f"http://127.0.0.1:{admin_port}/")
        wait_until(lambda: page_matches_api(browser, admin_port), what="the page to match")
        pill = _row(browser, "web", "b").find_element("css selector", ".state .agent")
        assert pill.text == "agent drain 50%"
        assert pill.get_attribute("title") == "deploy"
        assert _row(browser, "web", "a").find_elements("css selector", ".state .agent") == []
    finally:
        for agent in agents:
            agent.stop()


def test_dashboard_says_why_a_server_is_down_and_filters_those_up(browser, lbproxy):
    """SPEC §24: per real server its state and for how long, the last check's result and
    reason (refused, timed out, `expect` mismatch), rate now/max, errors and downtime; the
    process's version and uptime in the header; "hide servers that are up" hides `good`."""
    from lbproxy import __version__

    servers = [Answering("good", b"PONG\r\n"), Answering("nope", b"NOPE\r\n")]
    servers.append(Answering("silent", b""))
    refused = SimpleNamespace(name="refused", port=free_port())
    check = (
        'health_check: {type: send_expect, send: "PING\\r\\n", expect: "^PONG",'
        " interval: 200ms, timeout: 300ms, rise: 1, fall: 1}"
    )
    reasons = {
        "good": "ok",
        "nope": "fail send_expect check: '^PONG' not found in 6 bytes \"NOPE\\r\\n\" within 0.3s",
        "silent": "timeout send_expect check: nothing received within 0.3s",
        "refused": "fail send_expect check: connection refused",
    }
    port, admin_port = free_port(), free_port()
    try:
        lbproxy(with_admin(vs_config(port, [*servers, refused], "rr", check), admin_port))
        browser.get(f"http://127.0.0.1:{admin_port}/")

        def checks_shown() -> bool | list:
            shown = {name: _row(browser, "web", name).find_element("css selector", ".check").text
                     for name in reasons}  # fmt: skip
            return True if shown == reasons else [shown]

        wait_until(checks_shown, what="each server's last check and its reason")
        header = browser.find_element("id", "process").text
        assert header.startswith(f"lbproxy {__version__} · up "), header
        assert re.search(r"up \d+(s|m \d+s)$", header), header

        for _ in range(12):  # a burst for `good`, the only one up
            with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
                client.sendall(b"PING\r\n")
                assert client.recv(6) == b"PONG\r\n"

        def rates_shown() -> bool | list:
            document = api(admin_port)["virtual_servers"][0]
            rs = {s["name"]: s for s in document["real_servers"]}
            rate = rs["good"]["rate"]
            want = f"{number(rate['current'])} / {number(rate['max'])}"
            got = _row(browser, "web", "good").find_element("css selector", ".rate").text
            return True if rate["max"] > 0 and got == want else [(want, got)]

        wait_until(rates_shown, what="the rate now / max of good")
        for name in ("nope", "silent", "refused"):
            row = _row(browser, "web", name)
            assert row.find_element("css selector", ".health").text == "down"
            assert re.fullmatch(r"\d+(s|m \d+s)", row.find_element("css selector", ".since").text)
            assert re.fullmatch(
                r"\d+(s|m \d+s)", row.find_element("css selector", ".downtime").text
            )
            assert row.find_element("css selector", ".errors").text == "0"

        browser.find_element("id", "hide-up").click()
        wait_until(
            lambda: (
                not _row(browser, "web", "good").is_displayed()
                and all(
                    _row(browser, "web", n).is_displayed() for n in ("nope", "silent", "refused")
                )
            ),
            what="the servers that are up hidden",
        )
        browser.find_element("id", "hide-up").click()
        wait_until(lambda: _row(browser, "web", "good").is_displayed(), what="shown again")
    finally:
        for server in servers:
            server.stop()


def test_dashboard_shows_ejection_and_panic_and_never_hides_an_ejected_server(
    browser, name_servers, lbproxy
):
    """Outlier detection ejects `refusing` (nothing listens there; no health check, so
    its health stays up): its row says "ejected" and for how long, with the time it
    comes back as the tooltip, and "hide servers that are up" keeps it shown; with one
    server of three ejected, panic_threshold 70 puts the virtual server in panic, shown
    beside its name. The CSV says both, in columns appended at the end."""
    a, b = name_servers("a", "b")
    refusing = SimpleNamespace(name="refusing", port=free_port())
    port, admin_port = free_port(), free_port()
    extra = (
        "retries: 3\nconnect_timeout: 300ms\nhealth_check: {type: none}\npanic_threshold: 70\n"
        "outlier_detection: {consecutive_failures: 2, base_ejection_time: 120s, "
        "max_ejection_time: 120s, max_ejection_percent: 100}"
    )
    lbproxy(with_admin(vs_config(port, [a, b, refusing], "rr", extra), admin_port), [port])

    def ejected() -> dict | None:
        ask_name(port)
        (vs,) = api(admin_port)["virtual_servers"]
        rs = {s["name"]: s for s in vs["real_servers"]}
        return vs if rs["refusing"]["ejected_until"] and vs["panic"] else None

    vs = wait_for(ejected, what="refusing ejected and the virtual server in panic")
    until = {s["name"]: s for s in vs["real_servers"]}["refusing"]["ejected_until"]
    browser.get(f"http://127.0.0.1:{admin_port}/")
    wait_until(lambda: page_matches_api(browser, admin_port), what="the page to match")
    pill = read_page(
        lambda: _row(browser, "web", "refusing").find_element("css selector", ".health .ejected")
    )
    assert re.fullmatch(r"ejected (1m \d+s|\d+s)", pill.text), pill.text
    assert pill.get_attribute("title").endswith(f"not picked until {until}")
    assert _row(browser, "web", "a").find_elements("css selector", ".health .ejected") == []
    panic = browser.find_element("css selector", 'section.vs[data-vs="web"] .vs-head .panic')
    assert panic.text == "panic" and "as if up" in panic.get_attribute("title")

    browser.find_element("id", "hide-up").click()
    wait_until(
        lambda: (
            not _row(browser, "web", "a").is_displayed()
            and not _row(browser, "web", "b").is_displayed()
            and _row(browser, "web", "refusing").is_displayed()
        ),
        what="a and b hidden, the ejected server still shown",
    )

    status, body = http("GET", f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers.csv")
    assert status == 200
    header, *rows = list(csv.reader(io.StringIO(body.decode())))
    assert header[-5:-3] == ["ejected_until", "panic"]
    by_name = {row[1]: dict(zip(header, row, strict=True)) for row in rows}
    assert by_name["refusing"]["ejected_until"] == until
    assert by_name["a"]["ejected_until"] == ""
    assert {row["panic"] for row in by_name.values()} == {"1"}
