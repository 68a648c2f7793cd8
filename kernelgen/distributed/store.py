"""The rendezvous: rank 0 listens on MASTER_ADDR:MASTER_PORT, every other rank connects and says who it is;
once all have joined, rank 0 answers each with the same welcome (which carries, for NCCL, the unique id).

The connections stay open afterwards, a star around rank 0: the NumPy communicator's collectives and the
barrier run over them.  A shared token (KERNELGEN_DIST_TOKEN, which the launcher sets) keeps a stray
connection or another job's rank from joining.  Every wait has a deadline and the error names the ranks
still missing.
"""
from __future__ import annotations

import hmac
import socket
import time

from kernelgen.distributed import wire

RETRY_S = 0.05  # a rank that starts before rank 0 listens retries its connection this often


class RendezvousError(RuntimeError):
    """The ranks did not all meet: one is missing, mismatched or gone."""


def _missing(joined, world_size):
    return [r for r in range(1, world_size) if r not in joined]


class TCPStore:
    """The star of connections around rank 0.  `welcome` (rank 0 only): a JSON-able dict every rank gets back
    from join() as self.welcome."""

    def __init__(self, rank, world_size, addr, port, token="", timeout=300.0, welcome=None):
        self.rank, self.world_size, self.timeout = rank, world_size, float(timeout)
        self.where = f"{addr}:{port}"
        self.peers = {}  # rank 0: {rank: socket}; others: {0: socket}
        if world_size == 1:
            self.welcome = dict(welcome or {})
        elif rank == 0:
            self.welcome = self._serve(addr, port, token, dict(welcome or {}))
        else:
            self.welcome = self._join(addr, port, token)

    def _serve(self, addr, port, token, welcome):
        deadline = time.monotonic() + self.timeout
        try:
            server = socket.create_server((addr, port))
        except OSError as e:
            raise RendezvousError(f"rank 0 cannot listen on {self.where} (MASTER_ADDR:MASTER_PORT): {e}") from None
        with server:
            while len(self.peers) < self.world_size - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = _missing(self.peers, self.world_size)
                    self.close()
                    raise RendezvousError(
                        f"rendezvous at {self.where} timed out after {self.timeout:g} s: rank(s) {missing} never "
                        f"joined (not started, crashed during start-up, or started with another MASTER_ADDR / "
                        f"MASTER_PORT / WORLD_SIZE)")
                server.settimeout(left)
                try:
                    sock, _ = server.accept()
                except socket.timeout:
                    continue
                self._admit(sock, token, min(left, 30.0))
        for r, sock in sorted(self.peers.items()):
            wire.send(sock, {"op": "welcome", **welcome})
        return welcome

    def _admit(self, sock, token, timeout):
        """Take a joining rank's hello; a connection that is not a rank of this job is closed and ignored,
        a rank of this job that is inconsistent is an error."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            hello, _ = wire.recv(sock, "a joining rank", timeout)
        except wire.PeerError:
            sock.close()
            return
        if hello.get("op") != "hello" or not hmac.compare_digest(str(hello.get("token", "")), token):
            sock.close()  # another job's rank, or not a rank at all: not ours to fail on
            return
        r, w = hello.get("rank"), hello.get("world_size")
        if w != self.world_size:
            self.close()
            raise RendezvousError(f"rank {r} has WORLD_SIZE {w}, rank 0 has {self.world_size}")
        if not isinstance(r, int) or not 0 < r < self.world_size or r in self.peers:
            self.close()
            raise RendezvousError(f"a second rank {r} (or one out of range 1..{self.world_size - 1}) joined "
                                  f"{self.where}: RANK must be unique per process")
        self.peers[r] = sock

    def _join(self, addr, port, token):
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                sock = socket.create_connection((addr, port), timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise RendezvousError(f"rank {self.rank}: could not reach rank 0 at {self.where} within "
                                          f"{self.timeout:.0f} s ({e}): is rank 0 running, on that address?") from None
                time.sleep(RETRY_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peers[0] = sock
        wire.send(sock, {"op": "hello", "rank": self.rank, "world_size": self.world_size, "token": token})
        try:
            welcome, _ = wire.recv(sock, "rank 0's welcome", max(0.1, deadline - time.monotonic()))
        except wire.PeerError as e:
            self.close()
            raise RendezvousError(f"rank {self.rank}: rendezvous at {self.where} failed: {e} (another rank "
                                  f"never joined, or rank 0 refused this one)") from None
        welcome.pop("op", None)
        return welcome

    def barrier(self, timeout=None):
        """Every rank waits here until all have arrived; the error names the ranks that did not."""
        timeout = self.timeout if timeout is None else timeout
        if self.world_size == 1:
            return
        if self.rank != 0:
            wire.send(self.peers[0], {"op": "barrier"})
            self.expect(0, "barrier", timeout)
            return
        for r in sorted(self.peers):
            self.expect(r, "barrier", timeout)
        for r in sorted(self.peers):
            wire.send(self.peers[r], {"op": "barrier"})

    def expect(self, r, op, timeout):
        """The next message from rank r, which must be `op`."""
        header, payload = self.recv(r, timeout)
        if header.get("op") != op:
            raise RendezvousError(f"rank {r} sent {header.get('op')!r} while rank {self.rank} waits in {op!r}: "
                                  f"the ranks are running different collectives")
        return header, payload

    def recv(self, r, timeout):
        try:
            return wire.recv(self.peers[r], f"rank {r}", timeout)
        except wire.PeerError as e:
            raise RendezvousError(f"rank {self.rank}: {e}") from None

    def close(self):
        for sock in self.peers.values():
            sock.close()
        self.peers = {}
