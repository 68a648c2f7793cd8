"""Framed messages over a TCP socket: the rendezvous store's and the NumPy communicator's transport.

A message is an 8-byte big-endian length, then that many bytes: a JSON header, a newline, and an optional raw
payload (an array's bytes).  Arrays travel as raw bytes with dtype and shape in the header, never pickled, so a
peer can send nothing that runs code on receipt.  Every receive has a deadline and names the peer it waited
for, so a rank that died or never came shows up as an error naming it instead of a hang.
"""
from __future__ import annotations

import json
import socket
import struct
import time

import numpy as np

_LEN = struct.Struct(">Q")
MAX_MESSAGE = 1 << 34  # 16 GiB: a length beyond any gradient bucket means a stray connection, not a peer


class PeerError(RuntimeError):
    """A peer closed its connection, sent garbage, or missed a deadline."""


def send(sock, header, payload=b""):
    head = json.dumps(header, separators=(",", ":")).encode() + b"\n"
    sock.sendall(_LEN.pack(len(head) + len(payload)) + head)
    if payload:
        sock.sendall(payload)


def _recv_exact(sock, n, peer, deadline):
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerError(f"timed out waiting for {peer}")
        sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            raise PeerError(f"timed out waiting for {peer}") from None
        except OSError as e:
            raise PeerError(f"lost the connection to {peer}: {e}") from None
        if k == 0:
            raise PeerError(f"{peer} closed its connection (the process exited or crashed)")
        got += k
    return buf


def recv(sock, peer, timeout):
    """(header dict, payload bytes) of the next message from `peer` (a description for errors)."""
    deadline = time.monotonic() + timeout
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, peer, deadline))
    if n > MAX_MESSAGE:
        raise PeerError(f"{peer} sent a {n}-byte message: not a kernelgen.distributed peer")
    body = _recv_exact(sock, n, peer, deadline)
    end = body.find(b"\n")
    try:
        header = json.loads(body[:end])
    except ValueError:
        raise PeerError(f"{peer} sent a malformed message: not a kernelgen.distributed peer") from None
    if end < 0 or not isinstance(header, dict):
        raise PeerError(f"{peer} sent a malformed message: not a kernelgen.distributed peer")
    return header, bytes(body[end + 1:])


def send_array(sock, a, **header):
    a = np.ascontiguousarray(a)
    send(sock, dict(header, dtype=a.dtype.str, shape=list(a.shape)), a.tobytes())


def recv_array(sock, peer, timeout, expect=None):
    """The array a peer sent with send_array; `expect` (an array) checks its dtype and shape."""
    header, payload = recv(sock, peer, timeout)
    if "dtype" not in header or "shape" not in header:
        raise PeerError(f"{peer} sent {header.get('op', 'a message')!r} where an array was expected")
    a = np.frombuffer(payload, np.dtype(header["dtype"])).reshape(header["shape"])
    if expect is not None and (a.dtype != expect.dtype or a.shape != expect.shape):
        raise PeerError(f"{peer} sent a {a.dtype} array of shape {a.shape} where this rank has "
                        f"{expect.dtype} {expect.shape}: the ranks are running different collectives")
    return a, header
