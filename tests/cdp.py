"""A small client of Chromium's DevTools protocol for the report test: Debian's headless
Chromium, one page, its console and network events, JavaScript, screenshots.

    with Browser() as b:
        page = b.open("file:///tmp/report.html")
        page.wait_for("document.body.dataset.rendered")
        page.evaluate("document.title")
        page.screenshot("/tmp/shot.png")

The browser runs with a fresh profile and no background connections (the machine's closed
network refuses them), and ``--no-sandbox`` (the tests run as root).  The WebSocket comes
from the ``websockets`` package (test extra).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-extensions", "--mute-audio",
    "--hide-scrollbars", "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
]


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser"):
        p = shutil.which(name)
        if p:
            return p
    return "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None


class CDPError(Exception):
    pass


class Browser:
    def __init__(self, binary: str | None = None, start_timeout: float = 60.0):
        self.binary = binary or chromium_binary()
        if not self.binary:
            raise CDPError("no chromium")
        self.profile = tempfile.mkdtemp(prefix="logjam-relay-chromium-")
        self.log = open(os.path.join(self.profile, "stderr.log"), "wb")
        self.proc = subprocess.Popen([self.binary, *CHROMIUM_FLAGS,
                                      f"--user-data-dir={self.profile}", "about:blank"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=self.log)
        port_file = os.path.join(self.profile, "DevToolsActivePort")
        deadline = time.monotonic() + start_timeout
        while True:
            if os.path.exists(port_file):
                lines = open(port_file).read().split("\n")
                if len(lines) >= 2 and lines[1]:
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise CDPError(f"chromium did not start (exit {self.proc.returncode}): "
                               + self.stderr()[-2000:])
            time.sleep(0.05)
        from websockets.sync.client import connect
        self._stack = contextlib.ExitStack()
        self.ws = self._stack.enter_context(
            connect(f"ws://127.0.0.1:{lines[0].strip()}{lines[1].strip()}", max_size=None,
                    open_timeout=start_timeout))
        self._ids = itertools.count(1)
        self.events: list[dict] = []

    def stderr(self) -> str:
        try:
            return open(os.path.join(self.profile, "stderr.log"), "rb").read().decode(
                "utf-8", "replace")
        except OSError:
            return ""

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 60.0) -> dict:
        i = next(self._ids)
        msg = {"id": i, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + timeout
        while True:
            m = json.loads(self.ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if m.get("id") == i:
                if "error" in m:
                    raise CDPError(f"{method}: {m['error']}")
                return m.get("result", {})
            if "method" in m:
                self.events.append(m)

    def pump(self, seconds: float) -> None:
        """Collect events for a while."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                m = json.loads(self.ws.recv(timeout=left))
            except TimeoutError:
                return
            if "method" in m:
                self.events.append(m)

    def open(self, url: str, width: int = 1280, height: int = 900) -> Page:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target,
                                                      "flatten": True})["sessionId"]
        page = Page(self, session)
        for domain in ("Page", "Runtime", "Log", "Network"):
            page.send(f"{domain}.enable")
        page.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        page.send("Page.navigate", {"url": url})
        page.wait_for("document.readyState === 'complete'")
        return page

    def close(self) -> None:
        try:
            if getattr(self, "_stack", None) is not None:
                self._stack.close()
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.log.close()
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Page:
    def __init__(self, browser: Browser, session: str):
        self.browser = browser
        self.session = session

    def send(self, method: str, params: dict | None = None, timeout: float = 60.0) -> dict:
        return self.browser.send(method, params, self.session, timeout)

    def evaluate(self, expr: str, timeout: float = 60.0):
        """The value of a JavaScript expression (promises awaited), as JSON."""
        r = self.send("Runtime.evaluate", {"expression": expr, "returnByValue": True,
                                           "awaitPromise": True}, timeout)
        if "exceptionDetails" in r:
            raise CDPError(f"{expr[:80]}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expr: str, timeout: float = 60.0):
        """Poll a JavaScript expression until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            v = self.evaluate(expr)
            if v:
                return v
            if time.monotonic() > deadline:
                raise CDPError(f"not true after {timeout} s: {expr}")
            self.browser.pump(0.05)

    def events(self) -> list[dict]:
        return [e for e in self.browser.events if e.get("sessionId") == self.session]

    def console_errors(self) -> list[str]:
        """Console errors, uncaught exceptions and the browser's own error log entries
        (failed loads, Content-Security-Policy violations)."""
        out = []
        for e in self.events():
            m, p = e["method"], e.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append("console: " + " ".join(str(a.get("value", a.get("description")))
                                                  for a in p.get("args", [])))
            elif m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                out.append("exception: " + str(d.get("exception", {}).get("description")
                                                or d.get("text")))
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append("log: " + p["entry"].get("text", ""))
        return out

    def requests(self) -> list[str]:
        """URLs of every request the page made."""
        return [e["params"]["request"]["url"] for e in self.events()
                if e["method"] == "Network.requestWillBeSent"]

    def screenshot(self, path: str, width: int = 1280) -> tuple[int, int]:
        """A PNG of the whole page; (width, height)."""
        h = int(self.evaluate("Math.ceil(document.documentElement.scrollHeight)"))
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": h, "deviceScaleFactor": 1, "mobile": False})
        # two animation frames: the page is laid out again at the new size
        self.evaluate("new Promise(r => requestAnimationFrame(() => requestAnimationFrame("
                      "() => r(true))))")
        data = self.send("Page.captureScreenshot", {"format": "png",
                                                    "captureBeyondViewport": True})["data"]
        with open(path, "wb") as fh:
            fh.write(base64.b64decode(data))
        return width, h
