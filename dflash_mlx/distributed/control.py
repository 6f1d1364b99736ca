"""The control channel of a run over several ranks: rank 0's orders to the others, heartbeats, the watchdog.

Rank 0 listens on a TCP port, announced to the others with one all_sum at start, and
every other rank connects to it (a star). For a sharded target rank 0 sends each target
operation down these connections before running its own share of it; data-parallel
training (``train/ranks.py``) uses it to hold the other ranks while rank 0 prepares the data.
The other ranks block on a socket read between orders, so an idle server costs them no
CPU: a rank waiting inside an MLX ring collective spins.

Faults. MLX's ring collectives fail within milliseconds when a peer's socket closes (a
killed rank), but block forever on a peer that stops answering (suspended, hung,
unplugged). So both ends of every connection send a heartbeat each second and watch
for the other's: a connection that closes without a goodbye, or ``TIMEOUT`` seconds
without a heartbeat, prints one line and ends the process (``os._exit(1)``); the ranks
still connected to it then see their connection close and end too.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import secrets
import socket
import struct
import sys
import threading
import time
from typing import Any

from ..errors import DFlashError

HEARTBEAT = 1.0  # seconds between heartbeats
TIMEOUT = 15.0  # seconds of silence after which a peer counts as stalled
CONNECT_TIMEOUT = 60.0  # for the other ranks to reach rank 0 at start-up


def fault(rank: int, message: str) -> None:
    """One line on stderr, then end this process at once (threads may be stuck in MLX)."""
    sys.stdout.flush()
    print(f"dflash-mlx: error: rank {rank}: {message}", file=sys.stderr, flush=True)
    os._exit(1)


def rank0_host() -> str:
    """The address the other ranks reach rank 0 at, from what the launcher set."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile:  # ring: one list of "ip:port" per rank
        with open(hostfile) as f:
            return json.load(f)[0][0].rsplit(":", 1)[0]
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return coordinator.rsplit(":", 1)[0]
    raise DFlashError(
        "cannot find rank 0's address for the control channel: launch with "
        "`mlx.launch --backend ring` (or jaccl) so that MLX_HOSTFILE is set"
    )


_driving: list["Control"] = []  # rank 0's channel, once a sharded run has started


def end_process(code: int) -> None:
    """Rank 0 of a sharded run ends as the other ranks do: goodbye, flush, ``os._exit``.

    Left to interpreter teardown, with the ring group and this channel's threads still
    alive, a rank 0 that had shut down cleanly once aborted (SIGABRT after serve's SIGTERM,
    seen in CI, not reproduced in 70 local runs). After the goodbye nothing is left that
    the OS does not free. Elsewhere (one process, or no run yet) this returns.
    """
    if not _driving:
        return
    for control in _driving:
        control.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Link:
    """One TCP connection between rank 0 and another rank: framed JSON messages."""

    def __init__(self, sock: socket.socket, peer: int):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        self.sock, self.peer = sock, peer
        self.lock = threading.Lock()
        self.seen = time.monotonic()
        self.closed = False  # the peer said goodbye

    def send(self, message: dict) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        with self.lock:
            self.sock.sendall(struct.pack(">I", len(data)) + data)

    def ping(self) -> None:
        # Never wait behind a large send to a peer that has stopped reading.
        if self.lock.acquire(blocking=False):
            try:
                self.sock.sendall(b"\0\0\0\x02{}")
            except OSError:
                pass  # the reader thread reports the closed connection
            finally:
                self.lock.release()

    def _exact(self, n: int) -> bytes | None:
        chunks = []
        while n:
            try:
                chunk = self.sock.recv(min(n, 1 << 20))
            except OSError:  # reset by a peer that died
                return None
            if not chunk:
                return None
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def receive(self) -> dict | None:
        """The next message that is not a heartbeat; None when the connection closed."""
        while True:
            head = self._exact(4)
            body = head and self._exact(struct.unpack(">I", head)[0])
            if body is None:
                return None
            self.seen = time.monotonic()
            message = json.loads(body)
            if message:
                return message


class Control:
    """This rank's end of the star: rank 0 holds a link to every other rank, they one to rank 0."""

    def __init__(self, rank: int, links: list[_Link]):
        self.rank, self.links = rank, links
        self.closing = False
        self.orders: queue.Queue[dict | None] = queue.Queue()
        for link in links:
            threading.Thread(target=self._read, args=(link,), daemon=True, name=f"dflash-control-{link.peer}").start()
        threading.Thread(target=self._watch, daemon=True, name="dflash-watchdog").start()
        if rank == 0:
            atexit.register(self.close)
            _driving.append(self)

    @classmethod
    def connect(cls, group) -> "Control":
        """Build the star; every rank of ``group`` calls this at the same point."""
        import mlx.core as mx

        rank, size = group.rank(), group.size()
        server = None
        offer = [0, 0, 0]
        if rank == 0:
            server = socket.create_server((rank0_host(), 0))
            offer = [server.getsockname()[1], secrets.randbits(31), secrets.randbits(31)]
        offer = mx.distributed.all_sum(mx.array(offer, mx.int32), group=group, stream=mx.cpu).tolist()
        port, key = offer[0], offer[1:]
        if rank == 0:
            server.settimeout(CONNECT_TIMEOUT)
            links = {}
            while len(links) < size - 1:
                try:
                    sock, _ = server.accept()
                except socket.timeout:
                    missing = sorted(set(range(1, size)) - set(links))
                    raise DFlashError(
                        f"ranks {missing} did not reach rank 0's control port {port} within "
                        f"{CONNECT_TIMEOUT:.0f} s: check that a firewall lets them connect"
                    ) from None
                link = _Link(sock, -1)
                sock.settimeout(CONNECT_TIMEOUT)
                try:
                    hello = link.receive()
                except (OSError, ValueError):
                    hello = None
                if hello and hello.get("key") == key and hello.get("rank") in range(1, size):
                    sock.settimeout(None)
                    link.peer = hello["rank"]
                    links[link.peer] = link
                else:
                    sock.close()  # not one of ours
            server.close()
            return cls(0, [links[r] for r in sorted(links)])
        try:
            sock = socket.create_connection((rank0_host(), port), timeout=CONNECT_TIMEOUT)
        except OSError as e:
            raise DFlashError(f"cannot reach rank 0's control port {port}: {e}") from None
        link = _Link(sock, 0)
        link.send({"rank": rank, "key": key})
        return cls(rank, [link])

    def _read(self, link: _Link) -> None:
        while (message := link.receive()) is not None:
            if message.get("op") == "bye":
                link.closed = True
                if self.rank:  # rank 0 is done: nothing is left to follow
                    sys.stdout.flush()
                    os._exit(0)
            elif self.rank:
                self.orders.put(message)
        if not (self.closing or link.closed):
            fault(self.rank, f"rank {link.peer} closed its connection: it exited or was killed")

    def _watch(self) -> None:
        last = time.monotonic()
        while True:
            time.sleep(HEARTBEAT)
            now = time.monotonic()
            if now - last > 3 * HEARTBEAT:  # this process was suspended: the silence was ours
                for link in self.links:
                    link.seen = max(link.seen, now)
            last = now
            for link in self.links:
                link.ping()
                if not self.closing and now - link.seen > TIMEOUT:
                    fault(
                        self.rank,
                        f"no heartbeat from rank {link.peer} for {TIMEOUT:.0f} s: it stalled, "
                        "or the network between us is down",
                    )

    def send(self, message: dict[str, Any]) -> None:
        """Rank 0: send an order to every other rank."""
        try:
            for link in self.links:
                link.send(message)
        except OSError as e:
            fault(self.rank, f"cannot send to the other ranks: {e}")

    def next_order(self) -> dict:
        """Another rank: wait (without spinning) for rank 0's next order."""
        return self.orders.get()

    def close(self) -> None:
        """Rank 0: tell the others to end, then stop watching them."""
        if self.closing:
            return
        self.closing = True
        for link in self.links:
            try:
                link.send({"op": "bye"})
            except OSError:
                pass
