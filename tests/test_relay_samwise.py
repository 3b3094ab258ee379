"""The relay with --samwise/--amqp-broker: requests spooled, published to a real RabbitMQ."""

import signal
import urllib.request

import pytest
import trio
import zmq
from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port
from logjam_relay.io import zmq_trio
from logjam_relay.protocols import samwise as p
from relay_harness import running_relay
from test_samwise_rabbitmq import Queue, get_all, rabbit  # noqa: F401  (rabbit: fixture)


async def test_relay_samwise_endpoint_publishes_to_rabbitmq(tmp_path, rabbit):  # noqa: F811
    port = free_port()
    q = await trio.to_thread.run_sync(Queue, "/")
    async with running_relay(tmp_path, samwise=[f"tcp://127.0.0.1:{port}"],
                             amqp_brokers=["main=amqp://guest:guest@127.0.0.1:5672/%2F"]) \
            as (relay, cl):
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port}")
            replies = []
            for i in range(20):
                await zmq_trio.send_multipart(
                    sock, [b"", *p.build_publish("amq.direct", q.key, b"m%d" % i)])
                with trio.fail_after(10):
                    replies.append(await zmq_trio.recv_multipart(sock))
            assert all(r == [b"", b"0", b""] for r in replies), replies[:3]
            await zmq_trio.send_multipart(sock, [b"", b"120", b"publish"])   # malformed
            with trio.fail_after(10):
                bad = await zmq_trio.recv_multipart(sock)
            assert bad[1] == b"-1" and len(bad) == 3
            # samwise_rpc_allow's default: exchange.delete is refused before any connection
            await zmq_trio.send_multipart(sock, [b"", *p.build_rpc("exchange.delete", "amq.direct")])
            with trio.fail_after(10):
                assert await zmq_trio.recv_multipart(sock) == [b"", b"-1", b"rpc method not allowed"]
            # an allowed one opens one rpc connection (the broker refuses to redeclare
            # amq.direct as not durable: nothing is left behind in the vhost)
            await zmq_trio.send_multipart(sock, [b"", *p.build_rpc("exchange.declare",
                                                                   "amq.direct", "direct")])
            with trio.fail_after(10):
                rpc_reply = await zmq_trio.recv_multipart(sock)
            got = await get_all(q, expect=20)
            with trio.fail_after(10):
                while relay.samwise.stats()["backlog_records"]:
                    await trio.sleep(0.02)
            url = f"http://127.0.0.1:{cl.settings.metrics_port}/metrics"
            text = await trio.to_thread.run_sync(
                lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        finally:
            ctx.destroy(linger=0)
        assert relay.samwise.stats()["accepted"] == 20
    samples = {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
               for fam in text_string_to_metric_families(text) for smp in fam.samples}

    def val(name, **labels):
        return samples[(name, tuple(sorted({"device": "0", **labels}.items())))]
    assert val("logjam_relay_samwise_requests_total", action="publish", outcome="accepted") == 20
    assert val("logjam_relay_samwise_requests_total", action="publish",
               outcome="malformed_publish") == 1
    assert val("logjam_relay_samwise_requests_total", action="rpc", outcome="not_allowed") == 1
    assert val("logjam_relay_samwise_accepted_total") == 20
    assert val("logjam_relay_samwise_delivered_total") == 20
    assert val("logjam_relay_samwise_publishes_total", broker="main", result="ack") == 20
    assert val("logjam_relay_samwise_broker_sent_total", broker="main") == 20
    assert val("logjam_relay_samwise_confirm_latency_seconds_count", broker="main") == 20
    assert val("logjam_relay_samwise_confirm_latency_seconds_sum", broker="main") > 0
    assert val("logjam_relay_samwise_broker_connected", broker="main") == 1
    assert val("logjam_relay_samwise_backlog_records") == 0
    assert val("logjam_relay_samwise_rpc_connections") == 0
    assert val("logjam_relay_samwise_rpc_waiting") == 0
    assert val("logjam_relay_samwise_rpc_connections_peak") == 1      # the one rpc above
    assert rpc_reply[1] == b"-1" and rpc_reply[2].startswith(b"main: 406"), rpc_reply
    assert val("logjam_relay_samwise_spool_segments") >= 1
    assert sorted(body for _props, body in got) == sorted(b"m%d" % i for i in range(20))


def _relay_connections(pid: int, port: int) -> int:
    import psutil
    return sum(1 for c in psutil.Process(pid).net_connections(kind="tcp")
               if c.raddr and c.raddr.port == port and c.status == "ESTABLISHED")


class CountingProxy:
    """A TCP proxy in front of RabbitMQ that counts the relay's broker connections: all of
    them (``total``), and at each new one how many the relay process has open (``peak``,
    from the kernel's socket table: the proxy's own view lags the relay's closes).  rpc
    connections live for milliseconds, too short for sampling the sockets now and then."""

    def __init__(self, target=("127.0.0.1", 5672)):
        self.target = target
        self.peak = self.total = 0
        self.port = 0
        self.pid = 0            # the relay process, set by the test

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client):
        self.total += 1
        if self.pid:
            self.peak = max(self.peak, _relay_connections(self.pid, self.port))
        try:
            async with client, await trio.open_tcp_stream(*self.target) as up:
                async with trio.open_nursery() as n:
                    async def pipe(a, b):
                        try:
                            while data := await a.receive_some(65536):
                                await b.send_all(data)
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            pass
                        finally:
                            n.cancel_scope.cancel()
                    n.start_soon(pipe, client, up)
                    n.start_soon(pipe, up, client)
        except OSError:
            pass


def _metric(port: int, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()):
                return smp.value
    raise KeyError(name)


@pytest.mark.slow
async def test_real_command_sigkill_loses_no_accepted_publish_and_bounds_rpc(
        tmp_path, rabbit, nursery):  # noqa: F811
    """The real `logjam-relay` command: a publish answered [0, ''] is in the samwise spool,
    so a SIGKILL in mid-stream loses none of them (the restarted relay publishes what was
    not confirmed; duplicates only from what was in flight).  The rpc flags bound a burst."""
    from relay_harness import relay_settings, start_process, stop_process
    q = await trio.to_thread.run_sync(Queue, "/")
    port = free_port()
    proxy = CountingProxy()
    await nursery.start(proxy.serve)
    broker = f"main=amqp://guest:guest@127.0.0.1:{proxy.port}/%2F"
    extra = ["--samwise", f"tcp://127.0.0.1:{port}", "--amqp-broker", broker,
             "--samwise-rpc-max-concurrent", "2", "--samwise-rpc-max-queued", "4"]
    settings = relay_settings(tmp_path)
    n_msgs, kill_at = 3000, 1500
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    proc = await trio.to_thread.run_sync(start_process, settings, extra)
    proxy.pid = proc.pid
    try:
        # rpc burst: at most 2 rpc connections besides the publishing one
        for i in range(100):
            await zmq_trio.send_multipart(sock, [b"", *p.build_rpc("exchange.declare",
                                                                   f"lj-burst-{i % 2}", "fanout")])
        replies = []
        with trio.fail_after(30):
            while len(replies) < 100:
                msg = zmq_trio.recv_multipart_nowait(sock)   # (a cancelled recv could lose one)
                if msg is not None:
                    replies.append(msg)
                    continue
                await trio.sleep(0.001)
        peak, rpc_conns = proxy.peak, proxy.total - 1
        proxy.pid = 0                   # the burst is over (the relay is killed below)
        ok = sum(r == [b"", b"0", b""] for r in replies)
        refused = sum(r == [b"", b"-1", b"too many rpc requests"] for r in replies)
        assert ok + refused == 100 and ok >= 6 and refused >= 1, replies
        # every admitted rpc had its own connection, never more than 2 besides publishing
        assert rpc_conns == ok and 2 <= peak <= 3, (rpc_conns, ok, peak)
        # publishes, SIGKILL after kill_at replies, restart on the same state dir
        accepted = 0
        for i in range(n_msgs):
            if i == kill_at:
                # what was confirmed by the broker just before the kill: the rest (at most)
                # was in flight, and only that may be published twice
                confirmed = await trio.to_thread.run_sync(
                    _metric, settings.metrics_port, "logjam_relay_samwise_delivered_total")
                assert stop_process(proc, signal.SIGKILL) == -signal.SIGKILL
                proc = await trio.to_thread.run_sync(start_process, settings, extra)
            await zmq_trio.send_multipart(sock, [b"", *p.build_publish("amq.direct", q.key,
                                                                       b"m%d" % i)])
            with trio.fail_after(10):
                assert await zmq_trio.recv_multipart(sock) == [b"", b"0", b""]
            accepted += 1
        with trio.fail_after(30):
            while await trio.to_thread.run_sync(
                    _metric, settings.metrics_port, "logjam_relay_samwise_backlog_records"):
                await trio.sleep(0.05)
    finally:
        ctx.destroy(linger=0)
        stop_process(proc)
    got = [body for _props, body in await get_all(q, expect=n_msgs)]
    want = {b"m%d" % i for i in range(n_msgs)}
    lost = want - set(got)
    dups = len(got) - len(set(got))
    print(f"samwise SIGKILL: accepted {accepted}, delivered {len(set(got))}, lost {len(lost)}, "
          f"duplicated {dups} (in flight at the kill <= {kill_at - int(confirmed)}); rpc burst 100: {ok} ok, {refused} refused, peak broker "
          f"connections {peak} (1 publishing + rpc; {rpc_conns} rpc connections in all)")
    assert not lost and accepted == n_msgs
    assert dups <= kill_at - confirmed      # at most what was unconfirmed at the kill


def test_bad_rpc_allow_is_one_line_exit_2(tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "logjam_relay", "--check-config",
                        "--samwise-rpc-allow", "exchange.declare,queue.purge"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    assert "samwise_rpc_allow" in r.stderr and "queue.purge" in r.stderr
