"""The running relay's CMDP STAT/LOG topics, decoded by ConstellationDAQ 1.0.2's classes."""

import logging

import trio
import zmq
from constellation.core.message.cmdp1 import CMDP1LogMessage, CMDP1Message, CMDP1StatMessage

from conftest import free_port
from logjam_relay.io import zmq_trio
from relay_harness import meta, running_relay, send

logging.addLevelName(logging.ERROR, "ERROR")  # undo constellation's global rename
logging.setLoggerClass(logging.Logger)


async def test_relay_publishes_stat_and_log_topics(tmp_path):
    port = free_port()
    async with running_relay(tmp_path, cmdp_port=port, cmdp_name="relay.test",
                             chirp_interface="127.0.0.1") as (relay, cl):
        ctx = zmq.Context()
        stat_sub = ctx.socket(zmq.SUB)
        stat_sub.setsockopt(zmq.SUBSCRIBE, b"STAT/")
        stat_sub.connect(f"tcp://127.0.0.1:{port}")
        log_sub = ctx.socket(zmq.SUB)
        log_sub.setsockopt(zmq.SUBSCRIBE, b"LOG/")
        log_sub.connect(f"tcp://127.0.0.1:{port}")
        try:
            push = cl.push()
            for _ in range(50):
                await send(push, [b"cmdp-test", b"logs", b"{}", meta()])
            stats = {}
            with trio.fail_after(10):
                while stats.get("STAT/INGEST_MSGS", 0) < 50 or not \
                        {"STAT/SEQUENCE", "STAT/INGEST_RATE"} <= set(stats):
                    frames = await zmq_trio.recv_multipart(stat_sub)
                    msg = CMDP1StatMessage.from_cmdp_message(CMDP1Message.disassemble(frames))
                    stats[frames[0].decode()] = msg.value
            assert stats["STAT/SEQUENCE"] >= 50
            # an invalid message makes the relay log a (rate-limited) warning: LOG topic
            sent_bad = 0
            with trio.fail_after(10):
                while True:
                    if sent_bad < 4:
                        await send(push, [b"cmdp-test", b"bad.topic", b"{}", meta()])
                        sent_bad += 1
                    with trio.move_on_after(0.5):
                        frames = await zmq_trio.recv_multipart(log_sub)
                        m = CMDP1LogMessage.from_cmdp_message(CMDP1Message.disassemble(frames))
                        if "invalid message (topic)" in m.log_message:
                            break
            assert frames[0].startswith(b"LOG/WARNING")
            with trio.fail_after(10):
                while stats.get("STAT/INVALID_TOPIC", 0) < 1:
                    frames = await zmq_trio.recv_multipart(stat_sub)
                    msg = CMDP1StatMessage.from_cmdp_message(CMDP1Message.disassemble(frames))
                    stats[frames[0].decode()] = msg.value
        finally:
            ctx.destroy(linger=0)
    assert not any(type(h).__name__ == "CMDPLogHandler"
                   for h in logging.getLogger("logjam_relay").handlers)
