"""The health endpoint's request parser (``protocols/http.py``, sans-IO) and the server
answering malformed requests over a real socket."""

import socket

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from logjam_relay.health.http import HTTPServer
from logjam_relay.protocols import http as hp

SCRAPE = (b"GET /metrics?x=1 HTTP/1.1\r\nHost: 127.0.0.1:8082\r\nUser-Agent: Prometheus/2\r\n"
          b"Accept: text/plain\r\nAuthorization:  Basic dTpw \r\n\r\n")


def read_all(data: bytes, step: int = 0, eof: bool = False):
    r = hp.RequestReader(max_request=512)
    chunks = [data[i:i + step] for i in range(0, len(data), step)] if step else [data]
    for c in chunks:
        r.receive_data(c)
        ev = r.next_event()
        if ev is not hp.NEED_DATA:
            return ev
    if eof:
        r.receive_data(b"")
    return r.next_event()


@pytest.mark.parametrize("step", [0, 1, 3, 17])
def test_scrape_request_in_any_chunking(step):
    req = read_all(SCRAPE, step)
    assert (req.method, req.target, req.path, req.version) == \
        ("GET", "/metrics?x=1", "/metrics", "HTTP/1.1")
    assert req.headers["authorization"] == "Basic dTpw"
    assert req.headers["user-agent"] == "Prometheus/2"


def test_bare_lf_two_part_line_and_leading_empty_lines():
    assert read_all(b"HEAD /readyz HTTP/1.0\n\n").method == "HEAD"
    assert read_all(b"GET /healthz\r\n\r\n").version == ""
    assert read_all(b"\r\nGET /healthz HTTP/1.1\r\n\r\n").path == "/healthz"


def test_incomplete_and_closed():
    assert read_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n") is hp.NEED_DATA
    assert read_all(b"GET /metrics HTTP/1.1\r\n", eof=True) is hp.CLOSED
    assert read_all(b"", eof=True) is hp.CLOSED


@pytest.mark.parametrize("data,reason,status", [
    (b"\r\n\r\n", "bad_request_line", 400),
    (b"GET\r\n\r\n", "bad_request_line", 400),
    (b"GET / HTTP/1.1 extra\r\n\r\n", "bad_request_line", 400),
    (b"GET  /metrics HTTP/1.1\r\n\r\n", "bad_request_line", 400),
    (b"GET /metrics SPDY/3\r\n\r\n", "bad_request_line", 400),
    (b"G(T /metrics HTTP/1.1\r\n\r\n", "bad_request_line", 400),
    (b"GET /met\x00rics HTTP/1.1\r\n\r\n", "bad_request_line", 400),
    (b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n", "bad_header", 400),
    (b"GET /metrics HTTP/1.1\r\nX-A: 1\r\n folded\r\n\r\n", "bad_header", 400),
    (b"GET /metrics HTTP/1.1\r\nBad Name: 1\r\n\r\n", "bad_header", 400),
    (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 600 + b"\r\n\r\n", "too_large", 431),
    (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 600, "too_large", 431),
])
def test_malformed_requests_raise_labelled_errors(data, reason, status):
    with pytest.raises(hp.HTTPError) as ei:
        read_all(data)
    assert (ei.value.reason, ei.value.status) == (reason, status)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=1024), st.integers(min_value=0, max_value=64), st.booleans())
def test_random_bytes_only_raise_http_error(data, step, eof):
    try:
        ev = read_all(data, step, eof)
    except hp.HTTPError as e:
        assert e.reason and e.status in (400, 431)
    else:
        assert ev is hp.NEED_DATA or ev is hp.CLOSED or isinstance(ev, hp.Request)


def test_encode_response():
    assert hp.encode_response(401, "text/plain", b"no\n", extra="WWW-Authenticate: Basic\r\n") \
        == (b"HTTP/1.1 401 Unauthorized\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n"
            b"WWW-Authenticate: Basic\r\nConnection: close\r\n\r\nno\n")
    assert hp.encode_response(200, "text/plain", b"", length=10).endswith(
        b"Content-Length: 10\r\nConnection: close\r\n\r\n")


def _exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)          # end of the request stream (EOF to the server)
        out = b""
        while chunk := s.recv(4096):
            out += chunk
        return out


async def test_server_answers_malformed_requests_and_keeps_serving():
    server = HTTPServer({"/metrics": lambda: (200, "text/plain", b"m 1\n")}, "127.0.0.1", 0,
                        threaded=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        port = server.bound_port

        async def ask(data):
            return await trio.to_thread.run_sync(_exchange, port, data)

        assert (await ask(b"GARBAGE\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
        assert (await ask(b"GET /metrics HTTP/1.1\r\nfolded\r\n\r\n")).startswith(
            b"HTTP/1.1 400 ")
        assert (await ask(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 9000)).startswith(
            b"HTTP/1.1 431 ")
        assert await ask(b"GET /metrics HTTP/1.1\r\n") == b""       # closed mid-head
        ok = await ask(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200 OK\r\n") and ok.endswith(b"\r\n\r\nm 1\n")
        assert (await ask(b"POST /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 405 ")
        nursery.cancel_scope.cancel()
    st_ = server.stats()
    assert st_["bad_requests"] == 3 and st_["requests"] == 2 and st_["timeouts"] == 0
    assert st_["bad_requests_by_reason"] == {"bad_request_line": 1, "bad_header": 1,
                                             "too_large": 1}
