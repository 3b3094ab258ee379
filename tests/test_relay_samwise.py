"""The relay with --samwise/--amqp-broker: requests spooled, published to a real RabbitMQ."""

import urllib.request

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
    assert val("logjam_relay_samwise_spool_segments") >= 1
    assert sorted(body for _props, body in got) == sorted(b"m%d" % i for i in range(20))
