"""A reserve of file descriptors for the relay's own files when the process runs out.

Every ZeroMQ peer, input connection and HTTP client is a file descriptor, and libzmq accepts
connections on its own thread until ``accept`` fails with ``EMFILE`` (it then retries at
once, spinning, for as long as connections wait).  The relay must still be able to roll a
spool segment, write its cursor logs and state files, restart an output worker and answer
``/metrics`` then.  So the process holds :data:`RESERVE` (``size`` descriptors open on
``/dev/null``, taken at start-up) and every fd the relay opens on those paths goes through
it:

* :meth:`FdReserve.open` tries ``os.open``; on ``EMFILE``/``ENFILE`` it closes one reserve
  slot and opens again.  Another thread (libzmq's accepting one) may take the freed number
  in between: the slot is then lost (``lost``) and the next one is tried.  The numbers it
  gave up are listed by :meth:`FdReserve.given_up`: the fd guard drops the connection
  libzmq accepted into one, so that the number comes back (``io/fdguard.py``).
* :meth:`FdReserve.dup` needs no free number at all: on ``EMFILE`` it ``dup2``'s the fd onto
  a slot (atomic: the slot's ``/dev/null`` is replaced by the duplicate).
* :meth:`FdReserve.close` gives the number back: while the reserve is short of ``size`` it
  ``dup2``'s ``/dev/null`` onto the fd (atomic: the file is closed and the number is a slot
  again, never free in between), else it closes it.  So a file the relay opened from the
  reserve returns its slot when it is closed, and the reserve only shrinks by ``lost``
  slots, which :meth:`FdReserve.refill` takes again once numbers are free.
* :meth:`FdReserve.refuse` and :meth:`FdReserve.accept` take a pending connection from a
  listening socket when ``accept`` failed with ``EMFILE``: ``refuse`` closes it at once
  (the number goes straight back to the reserve), ``accept`` hands it over (closed later
  with :meth:`close_socket`); both leave ``keep`` slots for the spool's files.  The
  listening socket is made non-blocking if it is not.

Before :meth:`FdReserve.fill` (tests, tools) the reserve is empty and every call is the
plain ``os`` call.  Thread-safe (the HTTP endpoint runs its own thread).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading

#: descriptors the command holds in reserve
DEFAULT_SIZE = 16
#: errors that mean "no descriptor left" (for the process, or the whole system)
OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)


def out_of_fds(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in OUT_OF_FDS


class FdReserve:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._null: int | None = None   # /dev/null: what the slots are dup2'd from
        self._slots: list[int] = []
        self._given: set[int] = set()  # numbers closed and not taken back (see given_up)
        self.size = 0
        # counters
        self.used = 0           # opens, dups and accepts served from a slot
        self.lost = 0           # slots another thread took between close and open
        self.refused = 0        # pending connections closed through refuse()
        self.refilled = 0       # slots taken again by refill()
        self.exhausted = 0      # calls that found no slot left (and raised)

    # ------------------------------------------------------------------ filling
    def fill(self, size: int = DEFAULT_SIZE) -> None:
        """Take ``size`` slots (at start-up, while numbers are free)."""
        with self._lock:
            if self._null is None:
                self._null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            self.size = max(self.size, size)
            while len(self._slots) < self.size:
                self._slots.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))

    def refill(self) -> int:
        """Take back lost slots while numbers are free; returns the slots held."""
        with self._lock:
            while self._null is not None and len(self._slots) < self.size:
                try:
                    fd = os.dup(self._null)
                except OSError:
                    break
                self._slots.append(fd)
                self._given.discard(fd)
                self.refilled += 1
            return len(self._slots)

    @property
    def held(self) -> int:
        return len(self._slots)

    def given_up(self) -> list[int]:
        """Numbers the reserve closed and did not get back (another thread may hold them
        now: the fd guard looks at them); :meth:`forget` one once it is accounted for."""
        with self._lock:
            return sorted(self._given)

    def forget(self, fd: int | None = None) -> None:
        """Stop listing ``fd`` (all of them: None) among :meth:`given_up`."""
        with self._lock:
            if fd is None:
                self._given.clear()
            else:
                self._given.discard(fd)

    def keep(self, share: float) -> int:
        """Slots a lesser use (refusing a connection, serving a scrape) leaves for the
        spool's files: ``share`` of the reserve."""
        return int(self.size * share)

    def stats(self) -> dict:
        return {"size": self.size, "held": len(self._slots), "used": self.used,
                "lost": self.lost, "refused": self.refused, "refilled": self.refilled,
                "exhausted": self.exhausted}

    # ------------------------------------------------------------------ using
    def open(self, path, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        """``os.open``, from the reserve when the process is out of descriptors."""
        try:
            return os.open(path, flags, mode, dir_fd=dir_fd)
        except OSError as e:
            if e.errno not in OUT_OF_FDS:
                raise
            first = e
        path = os.fsencode(path)        # nothing left to do between close and open
        with self._lock:
            while self._slots:
                slot = self._slots.pop()
                os.close(slot)
                try:
                    fd = os.open(path, flags, mode, dir_fd=dir_fd)
                except OSError as e:
                    if e.errno not in OUT_OF_FDS:
                        self._take_back(slot)
                        raise
                    self.lost += 1      # another thread took the number
                    self._given.add(slot)
                    continue
                self._given.discard(fd)
                self.used += 1
                return fd
            self.exhausted += 1
        raise first

    def dup(self, fd: int) -> int:
        """``os.dup``; when out of descriptors the duplicate takes a slot's number."""
        try:
            return os.dup(fd)
        except OSError as e:
            if e.errno not in OUT_OF_FDS:
                raise
            first = e
        with self._lock:
            if self._slots:
                slot = self._slots.pop()
                try:
                    os.dup2(fd, slot, inheritable=False)
                except OSError:
                    self._slots.append(slot)
                    raise
                self.used += 1
                return slot
            self.exhausted += 1
        raise first

    def close(self, fd: int) -> None:
        """Close ``fd``; while the reserve is short its number becomes a slot again."""
        with self._lock:
            self._given.discard(fd)
            if self._null is not None and len(self._slots) < self.size and fd != self._null:
                try:
                    os.dup2(self._null, fd, inheritable=False)
                except OSError:
                    pass
                else:
                    self._slots.append(fd)
                    return
        os.close(fd)

    def close_socket(self, sock) -> None:
        """:meth:`close` for a socket object (stdlib or trio): it is detached first."""
        try:
            import trio
            trio.lowlevel.notify_closing(sock)
        except (ImportError, RuntimeError, TypeError, ValueError):
            pass        # not in a trio thread, or not a socket trio knows
        fd = sock.detach()
        if fd is not None and fd >= 0:
            self.close(fd)

    @contextlib.contextmanager
    def room(self, n: int):
        """Free ``n`` slots for a block that makes descriptors itself (a socket pair, a
        child process), in case the process is out of them; :meth:`refill` afterwards
        takes back what the block did not keep."""
        with self._lock:
            freed = []
            while self._slots and len(freed) < n:
                freed.append(self._slots.pop())
                os.close(freed[-1])
        try:
            yield len(freed)
        finally:
            if freed and self.refill() < self.size:
                with self._lock:            # out of numbers: some may be another thread's
                    self._given.update(freed)

    # ---------------------------------------------------------------- accepting
    def _accept_one(self, listener_fd: int, slot: int) -> int | None:
        """With the lock held and ``slot`` closed: accept one pending connection."""
        if os.get_blocking(listener_fd):
            # libzmq leaves its listening sockets blocking; its accept copes with EAGAIN
            os.set_blocking(listener_fd, False)
        lst = socket.socket(fileno=listener_fd)
        try:
            conn, _ = lst.accept()
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as e:
            if e.errno in OUT_OF_FDS:
                self.lost += 1
                self._given.add(slot)
            elif e.errno not in (errno.ECONNABORTED, errno.EPROTO):
                raise
            return None
        finally:
            lst.detach()
        return conn.detach()

    def refuse(self, listener_fd: int, keep: int = 0) -> bool:
        """Take one pending connection off ``listener_fd`` and close it (the peer sees the
        connection closed at once instead of waiting); the number goes back to the
        reserve.  False when there was none, or when only ``keep`` slots are left (another
        thread may take the slot's number between close and accept: the spool's files come
        first)."""
        with self._lock:
            if len(self._slots) <= keep or self._null is None:
                return False
            slot = self._slots.pop()
            os.close(slot)
            try:
                conn = self._accept_one(listener_fd, slot)
            except OSError:
                self._take_back(slot)
                raise
            if conn is None:
                self._take_back(slot)
                return False
            os.dup2(self._null, conn, inheritable=False)    # closes it; a slot again
            self._slots.append(conn)
            self.refused += 1
            return True

    def accept(self, listener_fd: int, keep: int = 0) -> socket.socket | None:
        """Take one pending connection off ``listener_fd`` into a slot; None when there
        was none, or when only ``keep`` slots are left.  Close what it returns with
        :meth:`close_socket`."""
        with self._lock:
            if len(self._slots) <= keep:
                return None
            slot = self._slots.pop()
            os.close(slot)
            try:
                conn = self._accept_one(listener_fd, slot)
            except OSError:
                self._take_back(slot)
                raise
            if conn is None:
                self._take_back(slot)
                return None
            self.used += 1
            return socket.socket(fileno=conn)

    def _take_back(self, slot: int) -> None:
        """A closed slot was not used: take a number again (if one is free)."""
        try:
            fd = os.dup(self._null)
        except OSError:
            if slot not in self._given:
                self.lost += 1
                self._given.add(slot)
            return
        self._slots.append(fd)
        self._given.discard(fd)


#: the process's reserve (filled by the relay at start-up)
RESERVE = FdReserve()
