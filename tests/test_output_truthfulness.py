"""What operators read about outputs is true: TLS errors name their cause, Courier DNS
failures are counted, every URL parameter the README documents is accepted."""

from __future__ import annotations

import re
import ssl
import time
import urllib.request
from pathlib import Path

import pytest
import trio

from conftest import free_port
from logjam_relay.outputs import courier, lumberjack
from logjam_relay.outputs.supervisor import output_name, parse_outputs
from peers.lumberjack_reader import LumberjackReader
from relay_harness import relay_settings, stop_process

# start(): start_process, and the relay is killed after the test even when it fails
from test_relay_poison import _reap_relays, start  # noqa: F401  (_reap_relays: autouse)

README = Path(__file__).resolve().parent.parent / "README.md"


def documented_urls() -> dict[str, str]:
    """scheme -> the URL template the README's output list documents."""
    out = {}
    for m in re.finditer(r"^\* `((lumberjack|courier)://[^`]+)`", README.read_text(), re.M):
        out[m.group(2)] = m.group(1)
    return out


def _value(scheme: str, key: str, raw: str, tls_files) -> str:
    """A valid value for a documented parameter (the README shows placeholders)."""
    if key in ("ca", "cert"):
        return tls_files["ca"] if key == "ca" else tls_files["client"]
    if key == "key":
        return tls_files["client"]
    if raw in ("NAME", "...", "") or raw.isupper():
        return "co-1" if key == "name" else "relay.example"
    return raw


@pytest.mark.parametrize("scheme", ["lumberjack", "courier"])
def test_every_documented_url_parameter_is_accepted(scheme, tls_files):
    urls = documented_urls()
    assert set(urls) == {"lumberjack", "courier"}, "README lists no output URLs"
    template = urls[scheme]
    query = template.partition("?")[2]
    params = [p.partition("=") for p in query.split("&")]
    assert len(params) >= 10
    keys = [k for k, _, _ in params]
    assert "name" in keys
    parse = lumberjack.parse_url if scheme == "lumberjack" else courier.parse_url
    hostport = "127.0.0.1:5044" if scheme == "lumberjack" else "127.0.0.1:5043"
    # each documented parameter alone, with its documented (or a valid) value
    for key, _, raw in params:
        value = _value(scheme, key, raw, tls_files)
        extra = "&cert=" + tls_files["client"] if key == "key" else ""
        url = f"{scheme}://{hostport}?{key}={value}{extra}"
        parse(url)
        parse_outputs([url])
    # all of them at once, as the README shows them
    full = "&".join(f"{k}={_value(scheme, k, v, tls_files)}" for k, _, v in params)
    cfg = parse(f"{scheme}://{hostport}?{full}")
    assert cfg.name == "co-1"
    assert output_name(f"{scheme}://{hostport}?{full}") == "co-1"


@pytest.mark.parametrize("scheme", ["lumberjack", "courier"])
@pytest.mark.parametrize("query,needle", [
    ("tls=off&ca={ca}", "'ca' given but tls=off"),
    ("tls=off&verify=off", "'verify' given but tls=off"),
    ("tls=off&server_name=x", "'server_name' given but tls=off"),
    ("key={ca}", "'key' given without 'cert'"),
    ("tls=maybe", "'tls': expected on/off"),
    ("cert=", "'cert' is empty"),
    ("tls=on&tls=off", "'tls' given twice"),
])
def test_both_output_urls_share_the_tls_rules(scheme, query, needle, tls_files):
    """One parser for the TLS part of both URLs (outputs/url_params.py): an option that
    tls=off would silently ignore is an error for Lumberjack as it was for Courier."""
    parse = lumberjack.parse_url if scheme == "lumberjack" else courier.parse_url
    with pytest.raises(ValueError, match=re.escape(f"{scheme} URL: parameter {needle}")):
        parse(f"{scheme}://127.0.0.1:5000?" + query.format(ca=tls_files["ca"]))


def test_courier_url_accepts_name():
    cfg = courier.parse_url("courier://h:5043?tls=off&name=co")
    assert cfg.name == "co"
    with pytest.raises(ValueError, match="name is empty"):
        courier.parse_url("courier://h:5043?tls=off&name=")


def _wait_log(path: Path, pattern: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        m = re.search(pattern, text)
        if m:
            return m.group(0)
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} not in the relay log:\n{text[-3000:]}")


def test_lumberjack_tls_verification_failure_is_named_in_the_log(tmp_path, tls_files):
    """The reader's certificate is signed by a CA the relay does not trust."""
    port = free_port()
    s = relay_settings(tmp_path)
    url = (f"lumberjack://127.0.0.1:{port}?tls=on&timeout=5&backoff_min=0.05&backoff_max=0.2"
           f"&name=lj")
    log = tmp_path / "relay.log"

    async def main():
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(tls_files["server"])
        reader = LumberjackReader(port=port, ssl_context=ctx)
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.serve)
            proc = await trio.to_thread.run_sync(lambda: start(
                s, ["--output", url, "--spool-dir", str(tmp_path / "spool")], log_path=log))
            try:
                line = await trio.to_thread.run_sync(
                    _wait_log, log, r"lumberjack lj: .*TLS certificate verification "
                                    r"failed: [^\n]*")
            finally:
                stop_process(proc)
            nursery.cancel_scope.cancel()
        return line

    line = trio.run(main)
    assert "unable to get local issuer certificate" in line, line
    assert "BrokenResourceError()" not in log.read_text()


def _metric(port: int, name: str, output: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and f'output="{output}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for {output} not in /metrics")


def test_courier_dns_failures_are_counted(tmp_path):
    s = relay_settings(tmp_path)
    url = "courier://no-such-host.invalid:5043?tls=off&backoff=0.05&backoff_max=0.1&name=co"
    log = tmp_path / "relay.log"
    proc = start(s, ["--output", url, "--spool-dir", str(tmp_path / "spool")],
                         log_path=log)
    try:
        deadline = time.monotonic() + 20
        while _metric(s.metrics_port, "logjam_relay_output_connect_failures_total", "co") < 3:
            assert time.monotonic() < deadline, "connect failures not counted"
            time.sleep(0.1)
        _wait_log(log, r"courier co no-such-host.invalid:5043: dns: DNS lookup failed")
    finally:
        assert stop_process(proc) == 0


@pytest.mark.parametrize("scheme", ["lumberjack", "courier"])
def test_heartbeats_are_not_backlog_of_a_down_output(tmp_path, scheme):
    """Heartbeats are spooled (the archive keeps every sequence number) but an output
    never forwards them: a down output acknowledges them at once, so an idle relay's
    backlog does not grow; events do count."""
    import zmq

    from relay_harness import meta
    port = free_port()                       # nobody listens here
    s = relay_settings(tmp_path)             # heartbeat every 0.2 s
    url = (f"lumberjack://127.0.0.1:{port}?tls=off&backoff_min=0.05&backoff_max=0.2&name=o"
           if scheme == "lumberjack" else
           f"courier://127.0.0.1:{port}?tls=off&backoff=0.05&backoff_max=0.2&name=o")
    proc = start(s, ["--output", url, "--spool-dir", str(tmp_path / "spool")],
                         log_path=tmp_path / "relay.log")
    try:
        deadline = time.monotonic() + 20
        while _metric(s.metrics_port, "logjam_relay_output_connect_failures_total", "o") < 20:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # 20 failed attempts at >= 0.05 s apart: at least 5 heartbeats spooled meanwhile
        assert _metric(s.metrics_port, "logjam_relay_output_backlog_records", "o") <= 2
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{s.pull_port}")
        for i in range(5):
            push.send_multipart([b"hb-test", b"logs.hb", b'{"n":%d}' % i, meta()])
        push.close(linger=2000)
        ctx.term()
        deadline = time.monotonic() + 20
        while _metric(s.metrics_port, "logjam_relay_output_backlog_records", "o") < 5:
            assert time.monotonic() < deadline, "events not counted as backlog"
            time.sleep(0.1)
    finally:
        assert stop_process(proc) == 0
