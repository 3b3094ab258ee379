"""The relay's documented RSS ceiling (docs/operations.md, "Memory"): the relay process
and, with ``output_isolation = "process"`` (the default), its output worker processes,
together.

Every place that can hold data in memory is bounded by a setting; :func:`ceiling` adds
the bounds up for a given configuration.  ``tests/test_memory_ceiling.py`` runs the real
command under ``RLIMIT_AS`` set from this figure and throws bombs, huge frames, floods
and a stalled subscriber at it; the peak RSS must stay below.

What is not bounded by a setting -- and so left out here -- is written down in the docs:
a ZeroMQ message with an unbounded number of frames (``MAXMSGSIZE`` bounds each frame;
libzmq has no limit on frames per message).  The number of connected peers (each one gets
its own ``rcv_hwm`` queue and connection buffers) is bounded by ``zmq_max_peers`` per
socket (io/peers.py, enforced by the ZAP handler); with ``zmq_max_peers = 0`` the formula
takes the numbers of peers as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Settings
from ..io.subscriptions import MAX_TOPIC_BYTES
from .spoolwrite import relay_fsync_policy

MiB = 1024 * 1024

#: frames besides the body: app-env, topic, meta (24), routing id, empty -- generous
ENVELOPE_BYTES = 1024
#: libzmq's subscription trie costs about this much per topic byte received (a node per
#: byte; measured with random topics: 12.4 KB for 255 bytes, 1.8 KB for 32 bytes)
TRIE_BYTES_PER_TOPIC_BYTE = 50
#: subscriptions that may still get in past the cap: between two checks of the guard (it
#: looks at the connections' TCP byte counts every 100 subscriptions it reads), and from
#: connections being cut, which libzmq took in before the guard could read them and holds
#: until it has ended them (tests/test_combined_attack.py asserts this allowance; measured:
#: at most 2,192 held on a cap of 2,000)
SUBSCRIPTION_OVERSHOOT_PAIRS = 1000
SUBSCRIPTION_OVERSHOOT_BYTES = SUBSCRIPTION_OVERSHOOT_PAIRS * (MAX_TOPIC_BYTES + 12)
#: copies of a drained batch alive at once: the frames, the spool's encoded write, and
#: the compressed bodies with -x
BATCH_COPIES = 3
#: what one ZeroMQ connection costs besides its queue: libzmq's engine, session and pipe,
#: the 8 KiB decoder and encoder buffers, the guard's dup (measured idle: 11-25 KB).
#: (One name per term: until 2026-12 the input term below had this name too, and its
#: later definition made ceiling() charge 160 KiB per ZeroMQ connection.)
ZMQ_CONNECTION_BYTES = 64 * 1024
#: the samwise endpoint's per-peer queue never exceeds libzmq's default
SAMWISE_MAX_RCV_HWM = 1000
#: allocator slack (glibc arenas, fragmentation) on top of the sum
SLACK_FRACTION = 0.10
SLACK_BYTES = 32 * MiB


@dataclass(frozen=True)
class Ceiling:
    baseline: int
    ingress_queues: int
    ingest_batches: int
    pub_queue: int
    output_windows: int
    subscriptions: int
    output_workers: int
    connections: int
    slack: int
    inputs: int = 0
    cmdp: int = 0

    @property
    def total(self) -> int:
        return (self.baseline + self.ingress_queues + self.ingest_batches + self.pub_queue
                + self.output_windows + self.subscriptions + self.output_workers
                + self.connections + self.slack + self.inputs + self.cmdp)

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / MiB:.0f}" for k, v in self.__dict__.items())
        return f"RSS ceiling {self.total / MiB:.0f} MiB ({parts}; MiB)"


def samwise_rcv_hwm(settings: Settings) -> int:
    """RCVHWM (and SNDHWM) per peer of the samwise endpoint: rcv_hwm, at most 1000."""
    hwm = settings.rcv_hwm
    return SAMWISE_MAX_RCV_HWM if hwm == 0 else min(hwm, SAMWISE_MAX_RCV_HWM)


def input_sockets(settings: Settings) -> int:
    """ZeroMQ sockets that take messages in: ROUTER, PULL, samwise."""
    return ((1 if settings.router_port else 0) + (1 if settings.pull_port else 0)
            + (1 if settings.samwise else 0))


def subscriber_sockets(settings: Settings) -> int:
    """XPUB sockets: PUB, stats, CMDP."""
    return 1 + (1 if settings.stats_port else 0) + (1 if settings.cmdp_port else 0)


def output_window_bytes(settings: Settings) -> int:
    """Events the outputs may hold at once, each up to max_event_bytes decoded and again
    encoded (x2): window x pipeline per Lumberjack output, payload x pending per Courier;
    plus, per output, the two read chunks at the ends of its in-flight records (a worker's
    records stay in the chunks they were read from, spool/_recblock.h)."""
    from ..outputs.supervisor import parse_outputs
    from ..spool.tail import SegmentTail
    total = 0
    for spec in parse_outputs(settings.outputs):
        if spec.scheme == "lumberjack":
            from ..outputs.lumberjack_config import parse_url
            cfg = parse_url(spec.url)
            events = cfg.window * cfg.pipeline
        else:
            from ..outputs.courier_config import parse_url as parse_courier
            cfg = parse_courier(spec.url)
            events = cfg.payload_size * cfg.max_pending
        total += 2 * events * settings.max_event_bytes + 2 * SegmentTail.CHUNK
    return total


#: what a Lumberjack/Courier input connection holds outside max_held_bytes: its objects
#: (measured 7 KiB plain, 27 KiB with TLS), a read in flight and TLS's incoming buffer
#: (64 KiB each)
INPUT_CONNECTION_BYTES = 160 * 1024
#: json.loads of one event (the input's mapping) at its worst: 27x its size for
#: ``[{},{},...]`` (tracemalloc)
JSON_EXPANSION = 32


def input_bytes(settings: Settings) -> int:
    """What the Lumberjack/Courier inputs may hold (docs/inputs.md, "Memory"): per input,
    ``max_held_bytes`` shared by its connections plus ``max_connections`` x
    :data:`INPUT_CONNECTION_BYTES`; and once, for the one batch being decoded at a time (the
    event loop decodes one after the other), 3 x ``max_batch_bytes`` (an inflate's
    blocks, its output and the events decoded from it, before they are charged) and
    :data:`JSON_EXPANSION` x ``max_event_bytes`` (one event parsed to be mapped)."""
    from ..inputs import parse_inputs
    specs = parse_inputs(settings.inputs, max_event_bytes=settings.max_event_bytes)
    if not specs:
        return 0
    return (sum(s.max_held_bytes + s.max_connections * INPUT_CONNECTION_BYTES for s in specs)
            + max(3 * s.max_batch_bytes + JSON_EXPANSION * s.max_event_bytes for s in specs))


def output_workers(settings: Settings) -> int:
    """Output worker processes: one per output with ``output_isolation = "process"``."""
    if settings.output_isolation != "process":
        return 0
    from ..outputs.supervisor import parse_outputs
    return len(parse_outputs(settings.outputs))


def ceiling(settings: Settings, *, baseline: int, input_peers: int | None = None,
            subscriber_peers: int | None = None, output_bytes: int | None = None,
            worker_baseline: int = 0) -> Ceiling:
    """The RSS bound, in bytes, of a relay with ``settings``: the relay process plus its
    output worker processes (summed).

    ``baseline``: the idle RSS of the relay process measured on the host (Python, libzmq,
    the C twins); ``worker_baseline``: the idle RSS of one output worker process (Python,
    the encoders); ``input_peers``: ZeroMQ connections on ROUTER, PULL and samwise together
    (each has its own queue; default ``zmq_max_peers`` per socket); ``subscriber_peers``:
    connections on PUB, stats and CMDP together (default ``zmq_max_peers`` per socket, 0
    without that bound); ``output_bytes``: what the outputs may hold, wherever they run
    (default: :func:`output_window_bytes`).
    """
    s = settings
    if input_peers is None:
        if not s.zmq_max_peers:
            raise ValueError("zmq_max_peers is 0 (no bound): give input_peers")
        input_peers = s.zmq_max_peers * input_sockets(s)
    if subscriber_peers is None:
        subscriber_peers = s.zmq_max_peers * subscriber_sockets(s)
    message = s.resolved_zmq_max_msg_bytes() + ENVELOPE_BYTES     # the largest that gets in
    # each peer's queue holds rcv_hwm whole messages, plus one frame being read (samwise:
    # at most 1000; the largest queue of the input sockets is taken for every peer)
    hwm = max(s.rcv_hwm, samwise_rcv_hwm(s)) if s.samwise else s.rcv_hwm
    ingress = input_peers * (hwm + 1) * message
    inputs = input_sockets(s)
    # one batch per input socket in process: ingest_max_bytes + the message that crossed it
    batches = inputs * BATCH_COPIES * (s.ingest_max_bytes + message)
    if relay_fsync_policy(s).owner_syncs_batches:
        # what waits for the group commit's next round (relay/groupcommit.py): replies,
        # and records until ingest_max_bytes (+ the batch that crossed it)
        from .groupcommit import REPLY_BYTES, max_pending
        batches += max_pending(s.batch_size) * REPLY_BYTES + 2 * (s.ingest_max_bytes + message)
    # what PUB holds for the slowest subscriber (libzmq shares a message among
    # subscribers), and as much again in the hand-over to the XPUB's thread
    # (io/xpubthread.py: its queue holds snd_hwm messages)
    pub = 2 * s.snd_hwm * (s.max_event_bytes + ENVELOPE_BYTES)
    outputs = output_window_bytes(s) if output_bytes is None else output_bytes
    # per socket: what the guard lets all its connections together send before the one
    # that sent most is cut (the cap's worth of the longest topics), plus what arrives
    # before the next check
    sockets = subscriber_sockets(s)                   # PUB, stats, CMDP
    subs = sockets * (s.max_subscriptions * (MAX_TOPIC_BYTES + 12) + 4096
                      + SUBSCRIPTION_OVERSHOOT_BYTES) * TRIE_BYTES_PER_TOPIC_BYTE
    workers = output_workers(s) * worker_baseline
    conns = (input_peers + subscriber_peers) * ZMQ_CONNECTION_BYTES
    inputs_held = input_bytes(s)
    cmdp = cmdp_bytes(s)
    subtotal = baseline + ingress + batches + pub + outputs + subs + workers + conns \
        + inputs_held + cmdp
    slack = int(subtotal * SLACK_FRACTION) + SLACK_BYTES
    return Ceiling(baseline, ingress, batches, pub, outputs, subs, workers, conns, slack,
                   inputs=inputs_held, cmdp=cmdp)


def cmdp_bytes(settings: Settings) -> int:
    """CMDP (when on): its log queue (health/cmdp.py ``LOG_QUEUE_MAX_BYTES``), and its
    XPUB's queue for the slowest subscriber and the hand-over to the XPUB's thread (as for
    PUB), ``snd_hwm`` messages each of at most ``MAX_LOG_MESSAGE_BYTES`` (a LOG message's
    text and traceback are clipped; a STAT message is smaller)."""
    if not settings.cmdp_port:
        return 0
    from ..health.cmdp import LOG_QUEUE_MAX_BYTES, MAX_LOG_MESSAGE_BYTES, CMDPConfig
    return LOG_QUEUE_MAX_BYTES + 2 * CMDPConfig().snd_hwm * MAX_LOG_MESSAGE_BYTES
