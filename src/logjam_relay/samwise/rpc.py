"""samwise rpc (``exchange.declare`` / ``exchange.delete``), bounded and allow-listed.

Each call runs on a short-lived AMQP connection of its own, so a broker error that
closes the *connection* (an unknown exchange type is a 503) never disturbs the
publishing connection.  A burst of rpc requests used to open one connection each
(2,000 requests -> up to 144 at once); now:

* at most ``max_concurrent`` rpc connections are open at any time (all brokers together);
* at most ``max_queued`` rpc requests wait for one; beyond that a request is answered
  at once with ``[-1, 'too many rpc requests']``; a request that waited ``timeout``
  without getting a connection is answered ``[-1, 'rpc timeout']``;
* only the methods in ``allow`` are run; the others are answered
  ``[-1, 'rpc method not allowed']`` before any connection is opened (by default only
  ``exchange.declare``: any client could otherwise delete exchanges with the relay's
  credentials).
"""

from __future__ import annotations

import math

import trio

from ..protocols import amqp as A
from ..protocols import samwise as proto
from .config import BrokerConfig
from .link import Conn, LinkDown, down_reason

RPC_METHODS = (proto.EXCHANGE_DECLARE, proto.EXCHANGE_DELETE)
DEFAULT_ALLOW = (proto.EXCHANGE_DECLARE,)

NOT_ALLOWED = b"rpc method not allowed"
OVERLOADED = b"too many rpc requests"
QUEUE_TIMEOUT = b"rpc timeout"


class RpcOverloaded(Exception):
    pass


class RpcRunner:
    def __init__(self, *, max_concurrent: int = 8, max_queued: int = 64,
                 allow: tuple[str, ...] = DEFAULT_ALLOW, timeout: float = 5.0):
        self.allow = frozenset(allow)
        self.max_queued = max_queued
        self.timeout = timeout
        self._limiter = trio.CapacityLimiter(max_concurrent)
        self.waiting = 0          # requests waiting for a connection slot
        self.requests = 0         # requests admitted and not yet answered
        self.open_connections = 0
        self.peak_connections = 0

    def allowed(self, method: str) -> bool:
        return method in self.allow

    def admit(self) -> bool:
        """Called before a request task is started: False = answer OVERLOADED now.
        Requests beyond ``max_concurrent`` (counted in connections) wait, at most
        ``max_queued`` of them."""
        if self.requests >= self._limiter.total_tokens + self.max_queued:
            return False
        self.requests += 1
        return True

    def done(self) -> None:
        self.requests -= 1

    async def call(self, cfg: BrokerConfig, method: str, exchange: str,
                   exchange_type: str) -> str | None:
        """Run one rpc at one broker; None on success, else the error text.
        Raises :class:`RpcOverloaded` if no connection slot came within ``timeout``."""
        self.waiting += 1
        try:
            with trio.move_on_after(self.timeout) as scope:
                await self._limiter.acquire()
            if scope.cancelled_caught:
                raise RpcOverloaded
        finally:
            self.waiting -= 1
        try:
            self.open_connections += 1
            self.peak_connections = max(self.peak_connections, self.open_connections)
            return await rpc_once(cfg, method, exchange, exchange_type, self.timeout)
        finally:
            self.open_connections -= 1
            self._limiter.release()

    def stats(self) -> dict:
        return {"rpc_connections": self.open_connections, "rpc_waiting": self.waiting,
                "rpc_connections_peak": self.peak_connections}


async def rpc_once(cfg: BrokerConfig, method: str, exchange: str, exchange_type: str,
                   timeout: float) -> str | None:
    conn = Conn(cfg, " rpc")
    deadline = trio.current_time() + timeout
    try:
        with trio.move_on_at(deadline):
            await conn.open()
            conn.client.open_channel(1)
            await conn.expect(1, A.ChannelOpenOk)
            if method == proto.EXCHANGE_DECLARE:
                conn.client.exchange_declare(1, exchange, exchange_type)
                await conn.expect(1, A.ExchangeDeclareOk)
            else:
                conn.client.exchange_delete(1, exchange)
                await conn.expect(1, A.ExchangeDeleteOk)
            return None
        return "timeout"
    except LinkDown as e:
        return str(e)
    except (OSError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError,
            A.AmqpError, ValueError) as e:
        return down_reason(e, conn.client.state).replace("connect failed", "cannot connect")
    finally:
        left = deadline - trio.current_time()
        await conn.aclose(graceful=max(0.0, min(0.5, left)) if math.isfinite(left) else 0.5)
