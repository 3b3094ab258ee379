"""ZeroMQ CURVE on the relay's sockets, real sockets: accepted, refused, wrong server key,
plain clients on the secure and on the plain endpoint, a key removed at run time."""

import os
import subprocess
import sys

import pytest
import trio
import zmq
import zmq.auth
from zmq.utils.monitor import parse_monitor_message

from conftest import free_port
from logjam_relay.io import zmq_trio
from logjam_relay.io.curve import AllowList, load_secret_key
from relay_harness import meta, running_relay

OK = zmq.EVENT_HANDSHAKE_SUCCEEDED
FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL |
          zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@pytest.fixture
def keys(tmp_path):
    kd, allow = tmp_path / "keys", tmp_path / "allow"
    allow.mkdir()
    kd.mkdir()
    out = {}
    for name in ("relay", "agent", "stranger", "other_server"):
        pub, sec = zmq.auth.create_certificates(str(kd), name)
        out[name] = zmq.auth.load_certificate(sec) + (pub,)
    os.link(out["agent"][2], allow / "agent.key")
    out["allow"] = allow
    out["relay_secret_file"] = str(kd / "relay.key_secret")
    return out


def _client(ctx, kind, keys, who, server_key=None):
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    if who is not None:
        pub, sec = keys[who][:2]
        s.curve_publickey, s.curve_secretkey = pub, sec
        s.curve_serverkey = server_key or keys["relay"][0]
    mon = s.get_monitor_socket(OK | FAILED)
    return s, mon


async def _handshake(mon) -> int:
    """The first handshake outcome event of a client socket."""
    with trio.fail_after(10):
        while True:
            ev = parse_monitor_message(await zmq_trio.recv_multipart(mon))["event"]
            if ev & (OK | FAILED):
                return ev


async def _request(dealer, i=0):
    await zmq_trio.send_multipart(dealer, [b"", b"curve-test", b"logs.curve", b'{"i":%d}' % i,
                                           meta()])
    with trio.fail_after(10):
        return await zmq_trio.recv_multipart(dealer)


async def test_curve_accept_refuse_and_allow_list_changes(tmp_path, keys):
    plain_port = free_port()
    async with running_relay(tmp_path, curve_secret_key=keys["relay_secret_file"],
                             curve_allow_dir=str(keys["allow"]),
                             curve_plain_endpoints=[f"router=tcp://127.0.0.1:{plain_port}"]
                             ) as (relay, cl):
        s = cl.settings
        ctx = zmq.Context()
        try:
            router_ep = f"tcp://127.0.0.1:{s.router_port}"
            # 1. an allowed agent: handshake, request, 202
            d, mon = _client(ctx, zmq.DEALER, keys, "agent")
            d.connect(router_ep)
            assert await _handshake(mon) == OK
            assert await _request(d) == [b"curve-test", b"202 Accepted"]
            # 1b. a subscriber authenticates the same way and gets the stream
            sub, smon = _client(ctx, zmq.SUB, keys, "agent")
            sub.setsockopt(zmq.SUBSCRIBE, b"heartbeat")
            sub.connect(f"tcp://127.0.0.1:{s.pub_port}")
            assert await _handshake(smon) == OK
            with trio.fail_after(10):
                assert (await zmq_trio.recv_multipart(sub))[0] == b"heartbeat"
            # 2. an unknown key: refused by the ZAP handler
            x, xmon = _client(ctx, zmq.DEALER, keys, "stranger")
            x.connect(router_ep)
            assert await _handshake(xmon) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            assert relay.curve.refused["unknown_key"] >= 1
            # ... on PUB too: a subscriber with an unknown key, and one without CURVE
            xs, xsmon = _client(ctx, zmq.SUB, keys, "stranger")
            xs.setsockopt(zmq.SUBSCRIBE, b"")
            xs.connect(f"tcp://127.0.0.1:{s.pub_port}")
            assert await _handshake(xsmon) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            ps, psmon = _client(ctx, zmq.SUB, keys, None)
            ps.setsockopt(zmq.SUBSCRIBE, b"")
            ps.connect(f"tcp://127.0.0.1:{s.pub_port}")
            assert await _handshake(psmon) & FAILED
            # 3. a client that expects another server key: the handshake fails
            w, wmon = _client(ctx, zmq.DEALER, keys, "agent", server_key=keys["other_server"][0])
            w.connect(router_ep)
            assert await _handshake(wmon) & FAILED
            with trio.fail_after(10):               # counted by the relay's socket monitor
                while relay.curve.refused["handshake"] < 1:
                    await trio.sleep(0.01)
            # 3b. an impostor: the allowed agent's public key without its secret key
            imp = ctx.socket(zmq.DEALER)
            imp.setsockopt(zmq.LINGER, 0)
            imp.curve_publickey, imp.curve_secretkey = keys["agent"][0], keys["stranger"][1]
            imp.curve_serverkey = keys["relay"][0]
            imon = imp.get_monitor_socket(OK | FAILED)
            accepted_before = relay.curve.stats()["accepted"]
            imp.connect(router_ep)
            assert await _handshake(imon) & FAILED
            await zmq_trio.send_multipart(imp, [b"", b"curve-test", b"logs.curve", b"{}",
                                                meta()])
            with trio.move_on_after(0.5):          # nothing comes back: no session
                assert not await zmq_trio.recv_multipart(imp), "impostor got a reply"
            assert relay.curve.stats()["accepted"] == accepted_before
            imp.close()
            # 4. a plain client: refused on the secure endpoint, served on the plain one
            handshakes = relay.curve.refused["handshake"]
            p, pmon = _client(ctx, zmq.DEALER, keys, None)
            p.connect(router_ep)
            assert await _handshake(pmon) & FAILED
            with trio.fail_after(10):
                while relay.curve.refused["handshake"] <= handshakes:
                    await trio.sleep(0.01)
            p2, p2mon = _client(ctx, zmq.DEALER, keys, None)
            p2.connect(f"tcp://127.0.0.1:{plain_port}")
            assert await _handshake(p2mon) == OK
            assert await _request(p2, 1) == [b"curve-test", b"202 Accepted"]
            # 5. the agent's key removed at run time: its next connection is refused
            before = relay.curve.refused["unknown_key"]
            os.unlink(keys["allow"] / "agent.key")
            d2, d2mon = _client(ctx, zmq.DEALER, keys, "agent")
            d2.connect(router_ep)
            assert await _handshake(d2mon) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            assert relay.curve.refused["unknown_key"] > before
            # ... and added back: accepted again
            os.link(keys["agent"][2], keys["allow"] / "agent2.key")
            d3, d3mon = _client(ctx, zmq.DEALER, keys, "agent")
            d3.connect(router_ep)
            assert await _handshake(d3mon) == OK
            assert await _request(d3, 2) == [b"curve-test", b"202 Accepted"]
            st = relay.curve.stats()
        finally:
            ctx.destroy(linger=0)
    assert st["accepted"] >= 3 and st["refused"]["unknown_key"] >= 2
    assert st["plain_accepted"] >= 1                # the plain client on the plain port


def test_keygen_and_config_errors(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "logjam_relay", *args],
                              capture_output=True, text=True, timeout=30)

    r = cli("keygen", str(tmp_path / "k"), "relay")
    assert r.returncode == 0, r.stderr
    sec = tmp_path / "k" / "relay.key_secret"
    assert oct(sec.stat().st_mode & 0o777) == "0o600"
    pub, secret = load_secret_key(str(sec))
    assert pub.decode() in r.stdout and secret.decode() not in r.stdout
    # running it again keeps the pair (clients hold its public key) unless --force
    again = cli("keygen", str(tmp_path / "k"), "relay")
    assert again.returncode == 2 and "exists" in again.stderr and "--force" in again.stderr
    assert load_secret_key(str(sec)) == (pub, secret)
    assert cli("keygen", str(tmp_path / "k"), "../relay").returncode == 2
    forced = cli("keygen", str(tmp_path / "k"), "relay", "--force")
    assert forced.returncode == 0 and load_secret_key(str(sec))[0] != pub
    pub, secret = load_secret_key(str(sec))
    (tmp_path / "allow").mkdir()
    (tmp_path / "allow" / "bare").write_text(pub.decode() + "\n")
    assert AllowList(str(tmp_path / "allow")).keys == {pub}
    ok = cli("--check-config", "--curve-secret-key", str(sec), "--curve-allow-dir",
             str(tmp_path / "allow"), "--state-dir", str(tmp_path))
    assert ok.returncode == 0, ok.stderr
    for args, what in (
            (["--curve-secret-key", str(tmp_path / "k" / "relay.key"), "--curve-allow-dir",
              str(tmp_path / "allow")], "curve_secret_key (--curve-secret-key)"),
            (["--curve-secret-key", str(sec)], "curve_allow_dir"),
            (["--curve-allow-dir", str(tmp_path)], "needs curve_secret_key"),
            (["--curve-secret-key", str(sec), "--curve-allow-dir", str(tmp_path / "allow"),
              "--curve-plain-endpoint", "pub:tcp://x"], "curve_plain_endpoints")):
        r = cli("--check-config", *args)
        assert r.returncode == 2 and what in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
