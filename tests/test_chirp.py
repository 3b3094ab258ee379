"""CHIRP: sans-IO beacons against the reference captures and ConstellationDAQ's classes,
and discovery of the relay by ConstellationDAQ's own CHIRP manager on loopback."""

from __future__ import annotations

import logging
import threading
import uuid

import pytest
import trio
from constellation.core import base as c_base
from constellation.core.chirp import (
    CHIRPMessage,
    CHIRPMessageType,
    CHIRPServiceIdentifier,
    get_uuid,
)
from constellation.core.listener import StandaloneListener

from logjam_relay.health.chirp import resolve_interfaces
from logjam_relay.health.cmdp import CMDPConfig, CMDPSender
from logjam_relay.protocols import chirp

# Importing constellation renames level ERROR to "CRITICAL" and later swaps the logger
# class process-wide; undo that so other tests in this process see stock logging.
logging.addLevelName(logging.ERROR, "ERROR")
logging.setLoggerClass(logging.Logger)

GROUP = "cmdp_ref"
HOST = "PyRef.emitter1"
REF = {  # reference/cmdp.md, "Captured beacons"
    "OFFER": "43484952500102 0988a2f3080d591454b44119475269f5 eb0bd9ea4b45bd39227c65b82b447c13 03 d934",
    "REQUEST": "43484952500101 0988a2f3080d591454b44119475269f5 c43e74f2cab8490a1d5dc04baa7d6c19 03 0000",
    "DEPART": "43484952500103 0988a2f3080d591454b44119475269f5 eb0bd9ea4b45bd39227c65b82b447c13 03 d934",
}


def _ref(name: str) -> bytes:
    return bytes.fromhex(REF[name].replace(" ", ""))


# --------------------------------------------------------------------------- sans-IO


def test_name_ids_are_md5_of_lowercased_name():
    assert chirp.name_id(GROUP).hex() == "0988a2f3080d591454b44119475269f5"
    assert chirp.name_id(HOST).hex() == "eb0bd9ea4b45bd39227c65b82b447c13"
    assert chirp.name_id("LogjamRelay.Box") == chirp.name_id("logjamrelay.box")
    assert chirp.name_id("LogjamRelay.Box") == get_uuid("LogjamRelay.Box").bytes


@pytest.mark.parametrize("kind", ["OFFER", "DEPART"])
def test_beacons_match_reference_capture(kind):
    b = chirp.Beacon(chirp.MessageType[kind], chirp.name_id(GROUP), chirp.name_id(HOST),
                     chirp.Service.MONITORING, 55604)
    assert chirp.encode(b) == _ref(kind)
    assert chirp.decode(_ref(kind)) == b


def test_decode_reference_request():
    b = chirp.decode(_ref("REQUEST"))
    assert b.type is chirp.MessageType.REQUEST
    assert b.service is chirp.Service.MONITORING and b.port == 0


@pytest.mark.parametrize("mtype", list(chirp.MessageType))
@pytest.mark.parametrize("service", list(chirp.Service))
def test_interoperates_with_constellation_chirp_message(mtype, service):
    ours = chirp.Beacon(mtype, chirp.name_id("g"), chirp.name_id("T.h"), service, 65535)
    theirs = CHIRPMessage()
    theirs.unpack(chirp.encode(ours))
    assert (theirs.msgtype.value, theirs.serviceid.value, theirs.port) == (mtype, service, 65535)
    assert theirs.group_uuid == get_uuid("g") and theirs.host_uuid == get_uuid("T.h")
    back = CHIRPMessage(CHIRPMessageType(int(mtype)), get_uuid("g"), get_uuid("T.h"),
                        CHIRPServiceIdentifier(int(service)), 65535).pack()
    assert chirp.decode(back) == ours


@pytest.mark.parametrize(("data", "reason"), [
    (_ref("OFFER")[:-1], "bad_length"),
    (_ref("OFFER") + b"\x00", "bad_length"),
    (b"CHIRQ\x01" + _ref("OFFER")[6:], "bad_header"),
    (b"CHIRP\x02" + _ref("OFFER")[6:], "bad_header"),
    (_ref("OFFER")[:6] + b"\x00" + _ref("OFFER")[7:], "bad_type"),
    (_ref("OFFER")[:6] + b"\x04" + _ref("OFFER")[7:], "bad_type"),
    (_ref("OFFER")[:39] + b"\x00" + _ref("OFFER")[40:], "bad_service"),
    (_ref("OFFER")[:39] + b"\x05" + _ref("OFFER")[40:], "bad_service"),
])
def test_decode_errors(data, reason):
    with pytest.raises(chirp.ChirpError) as ei:
        chirp.decode(data)
    assert ei.value.reason == reason


def test_announcer_state_machine():
    a = chirp.Announcer(GROUP, HOST, {chirp.Service.MONITORING: 55604})
    assert a.start() == [_ref("OFFER")]
    assert a.stop() == [_ref("DEPART")]
    # a REQUEST for MONITORING from another host of our group is answered with our OFFER
    assert a.receive(_ref("REQUEST")) == [_ref("OFFER")]
    # ... not our own beacons, not other groups, not services we don't offer
    assert a.receive(_ref("OFFER")) == []
    req = chirp.decode(_ref("REQUEST"))
    other_group = chirp.encode(chirp.Beacon(req.type, chirp.name_id("other"), req.host_id, req.service))
    assert a.receive(other_group) == []
    control = chirp.encode(chirp.Beacon(req.type, req.group_id, req.host_id, chirp.Service.CONTROL))
    assert a.receive(control) == []
    own = chirp.encode(chirp.Beacon(req.type, req.group_id, a.host_id, req.service))
    assert a.receive(own) == []
    assert a.requests_answered == 1
    with pytest.raises(chirp.ChirpError):
        a.receive(b"junk")


def test_resolve_interfaces():
    assert resolve_interfaces("lo") == ["127.0.0.1"]
    assert resolve_interfaces("127.0.0.1") == ["127.0.0.1"]
    assert resolve_interfaces(None)[0] == "127.0.0.1"
    with pytest.raises(ValueError):
        resolve_interfaces("no-such-if0")


# --------------------------------------------------------------------------- discovery


class _Listener(StandaloneListener):
    """ConstellationDAQ's stand-alone monitoring listener, unchanged; runs in a thread."""


def start_listener(name: str, group: str) -> tuple[StandaloneListener, threading.Thread]:
    lst = _Listener(name, group, ["lo"])
    logging.setLoggerClass(logging.Logger)
    t = threading.Thread(target=lst.run_listener, name=f"cdaq-{name}", daemon=True)
    t.start()
    return lst, t


async def stop_listener(lst: StandaloneListener, t: threading.Thread) -> None:
    if lst._com_thread_evt is not None:
        lst._com_thread_evt.set()
    await trio.to_thread.run_sync(t.join, 10)
    assert not t.is_alive()
    if lst in c_base.SATELLITE_LIST:
        c_base.SATELLITE_LIST.remove(lst)


def monitoring_services(lst: StandaloneListener):
    return list(lst.get_discovered(CHIRPServiceIdentifier.MONITORING))


async def wait_until(pred, timeout: float = 10.0, what: str = "condition"):
    with trio.move_on_after(timeout):
        while not pred():
            await trio.sleep(0.02)
        return
    raise AssertionError(f"timed out waiting for {what}")


async def test_constellation_discovers_relay_and_sees_depart():
    group = "t" + uuid.uuid4().hex[:12]
    cfg = CMDPConfig(cmdp_port=1, cmdp_name="chirptest", chirp_group=group, stat_interval=10)
    sender = CMDPSender(cfg, endpoint="tcp://127.0.0.1:*", chirp_interfaces=["127.0.0.1"])
    listeners = []
    try:
        # `early` exists before the relay starts: it learns of it from the start OFFER
        # (or from the answer to its REQUEST, whichever comes first).
        listeners.append(start_listener("early", group))
        async with trio.open_nursery() as nursery:
            port = await nursery.start(sender.run)
            # `late` starts afterwards: only the relay's answer to its REQUEST can tell it.
            listeners.append(start_listener("late", group))
            host = get_uuid("LogjamRelay.chirptest")
            for lst, _ in listeners:
                await wait_until(lambda lst=lst: monitoring_services(lst), what="discovery")
                (svc,) = monitoring_services(lst)
                assert (svc.host_uuid, svc.address, svc.port) == (host, "127.0.0.1", port)
            assert sender.chirp.announcer.requests_answered >= 1
            nursery.cancel_scope.cancel()
        # cancelled: the relay sent DEPART, both listeners drop the service
        for lst, _ in listeners:
            await wait_until(lambda lst=lst: not monitoring_services(lst), what="DEPART")
    finally:
        for pair in listeners:
            await stop_listener(*pair)


async def test_relay_ignores_other_groups():
    group = "t" + uuid.uuid4().hex[:12]
    cfg = CMDPConfig(cmdp_port=1, cmdp_name="grouptest", chirp_group=group, stat_interval=10)
    sender = CMDPSender(cfg, endpoint="tcp://127.0.0.1:*", chirp_interfaces=["127.0.0.1"])
    lst = None
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(sender.run)
            lst = start_listener("othergroup", "x" + group)
            # the listener's REQUEST (other group) must not be answered; a REQUEST in our
            # group must be (proves the REQUEST got through at all)
            same = start_listener("samegroup", group)
            await wait_until(lambda: monitoring_services(same[0]), what="discovery")
            assert monitoring_services(lst[0]) == []
            assert sender.chirp.announcer.requests_answered >= 1
            await stop_listener(*same)
            nursery.cancel_scope.cancel()
    finally:
        if lst is not None:
            await stop_listener(*lst)


async def test_sender_survives_without_multicast(monkeypatch):
    from logjam_relay.health import chirp as chirp_io

    def refuse(self):
        raise OSError(19, "No such device")

    monkeypatch.setattr(chirp_io.ChirpBeacon, "_open", refuse)
    cfg = CMDPConfig(cmdp_port=1, cmdp_name="nomcast", chirp_group="g", stat_interval=10)
    sender = CMDPSender(cfg, endpoint="tcp://127.0.0.1:*", chirp_interfaces=["127.0.0.1"])
    async with trio.open_nursery() as nursery:
        port = await nursery.start(sender.run)
        assert port > 0 and "No such device" in sender.chirp_error
        nursery.cancel_scope.cancel()
