"""The run's store: the key-value store a live run keeps its membership on (generations, evictions, the stop and
the end, joiners' requests, the heal's rounds, the work queue, each group's rendezvous), open to holders of the run's
secret alone.

Who may read and write the run's store (the one place this rule lives):
- it listens on the address the run names and nowhere else: loopback for a run on this machine;
- every connection proves the run's secret before its first operation, and the store proves it back: each side
  sends a fresh nonce, then an HMAC-SHA256 of both nonces under the secret, compared as bytes in constant time; a
  connection that has not proved it within HANDSHAKE_S is closed, having read and written nothing;
- every message after that carries an HMAC, under a key of its connection's own (from the secret and both nonces),
  of its direction, its sequence number and its bytes: no message can be forged, replayed, reordered or moved to
  another connection, and a connection whose message does not verify is closed.
What it does not give: secrecy on the wire (a listener on the network path reads the values, as it reads the gloo
traffic of the model's tensors) and a bound on connections held open (up to MAX_CONNECTIONS: a process that
reaches the port can deny service, never change the run).

`RunStore` speaks c10d's Store interface, so torch's process groups form on it as they do on a TCPStore.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from fast.comm.comm import INTERRUPT_POLL_S  # (an interruptible wait asks the server this long at a time)

MAGIC = b"FASTRS01"
NONCE = 32
TAG = 32
HANDSHAKE_S = 5.0  # the longest a connection may take to prove the secret
MAX_CONNECTIONS = 4096  # open at once; beyond, a new connection is closed at once
MAX_HANDSHAKES = 64  # connections that have not proved the secret yet, at once
MAX_FRAME = 16 << 20  # one message's bytes: keys and values are small (ids, JSON, gloo's addresses)
_LENGTH = struct.Struct("!I")
_SEQUENCE = struct.Struct("!Q")

# operations (a message's first byte) and answers
SET, GET, ADD, CAS, CHECK, WAIT, DELETE, NUM_KEYS, APPEND, MULTI_GET, MULTI_SET = range(1, 12)
OK, TIMEOUT, BAD = 0, 1, 2


class Refused(dist.DistNetworkError):
    """The other side of a connection did not prove the run's secret."""


def _tag(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _fields(*fields: bytes) -> bytes:
    return b"".join(_LENGTH.pack(len(f)) + f for f in fields)


def _parse(body: bytes, start: int) -> list[bytes]:
    """The length-prefixed fields of `body` from `start`; ValueError if they do not fill it exactly."""
    fields, at = [], start
    while at < len(body):
        if at + _LENGTH.size > len(body):
            raise ValueError("a field's length is cut short")
        (n,) = _LENGTH.unpack_from(body, at)
        at += _LENGTH.size
        if at + n > len(body):
            raise ValueError("a field runs past its message")
        fields.append(body[at : at + n])
        at += n
    return fields


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the connection closed")
        data += chunk
    return bytes(data)


class _Channel:
    """One authenticated connection's messages: length, bytes, and the HMAC of direction, sequence and bytes."""

    def __init__(self, sock: socket.socket, key: bytes, sending: bytes, receiving: bytes) -> None:
        self.sock, self.key, self.sending, self.receiving = sock, key, sending, receiving
        self.sent = self.received = 0

    def send(self, body: bytes) -> None:
        tag = _tag(self.key, self.sending, _SEQUENCE.pack(self.sent), body)
        self.sent += 1
        self.sock.sendall(_LENGTH.pack(len(body)) + body + tag)

    def receive(self) -> bytes:
        (n,) = _LENGTH.unpack(_exactly(self.sock, _LENGTH.size))
        if n > MAX_FRAME:
            raise ConnectionError(f"a message of {n} bytes, over the store's {MAX_FRAME}")
        body, tag = _exactly(self.sock, n), _exactly(self.sock, TAG)
        if not hmac.compare_digest(tag, _tag(self.key, self.receiving, _SEQUENCE.pack(self.received), body)):
            raise ConnectionError("a message that does not verify")
        self.received += 1
        return body


def _session_key(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return _tag(secret, b"fast run store session", server_nonce, client_nonce)


# -- the server (the run's launcher) ---------------------------------------------------------------------------------
class RunStoreServer:
    """The run's store, served from this process on (`host`, `port`; 0: any free port) to holders of `secret`."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        self.secret = secret
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind(address)
        except OSError as e:
            self._listener.close()
            raise dist.DistNetworkError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        self._listener.listen(128)
        self.port: int = self._listener.getsockname()[1]
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._connections: set[socket.socket] = set()
        self._handshakes = 0
        self._lock = threading.Lock()
        self._closing = False
        self._refused_from: set[str] = set()
        self._thread = threading.Thread(target=self._accept, name="fast-run-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving: the listener and every connection close (a client waiting in one fails at once)."""
        with self._lock:
            self._closing = True
            connections = list(self._connections)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with self._changed:
            self._changed.notify_all()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:  # closed
                return
            with self._lock:
                if self._closing or len(self._connections) >= MAX_CONNECTIONS or self._handshakes >= MAX_HANDSHAKES:
                    conn.close()
                    continue
                self._connections.add(conn)
                self._handshakes += 1
            threading.Thread(target=self._serve, args=(conn, peer), name="fast-run-store-client", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        try:
            channel = self._handshake(conn, peer)
            if channel is None:
                return
            while True:
                channel.send(self._answer(channel.receive()))
        except (OSError, ConnectionError, struct.error):
            pass  # the client went, or sent what does not verify: its connection ends, nothing else
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket, peer: Any) -> _Channel | None:
        """The connection's channel once the client has proved the secret (and this store proved it back); None
        when it did not."""
        try:
            conn.settimeout(HANDSHAKE_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server_nonce = os.urandom(NONCE)
            conn.sendall(MAGIC + server_nonce)
            answer = _exactly(conn, NONCE + TAG)
            client_nonce, proof = answer[:NONCE], answer[NONCE:]
            if not hmac.compare_digest(proof, _tag(self.secret, b"fast run store client", server_nonce, client_nonce)):
                self._refuse(conn, peer)
                return None
            conn.sendall(b"\x01" + _tag(self.secret, b"fast run store server", client_nonce, server_nonce))
            conn.settimeout(None)
            key = _session_key(self.secret, server_nonce, client_nonce)
            return _Channel(conn, key, sending=b"S", receiving=b"C")
        finally:
            with self._lock:
                self._handshakes -= 1

    def _refuse(self, conn: socket.socket, peer: Any) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(b"\x00")
        host = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        if host not in self._refused_from:  # one line a host: a flood of them says nothing more
            self._refused_from.add(host)
            print(f"fast: refused a connection to the run's store from {host}: it did not prove the run's secret",
                  file=sys.stderr, flush=True)  # fmt: skip

    def _answer(self, body: bytes) -> bytes:
        if not body:
            return bytes([BAD])
        try:
            return self._operate(body[0], _parse(body, 1))
        except (ValueError, IndexError, UnicodeDecodeError, OverflowError):
            return bytes([BAD])

    def _operate(self, op: int, fields: list[bytes]) -> bytes:
        data, changed = self._data, self._changed
        if op == SET:
            key, value = fields[0].decode(), fields[1]
            with changed:
                data[key] = value
                changed.notify_all()
            return bytes([OK])
        if op in (GET, WAIT, MULTI_GET):
            timeout_s = int(fields[0]) / 1000.0
            keys = [k.decode() for k in fields[1:]]
            with changed:
                if not changed.wait_for(lambda: self._closing or all(k in data for k in keys), timeout_s):
                    return bytes([TIMEOUT])
                if self._closing:
                    raise ConnectionError("the store is closing")
                values = [data[k] for k in keys] if op != WAIT else []
            return bytes([OK]) + _fields(*values)
        if op == ADD:
            key, amount = fields[0].decode(), int(fields[1])
            with changed:
                value = int(data.get(key, b"0")) + amount
                data[key] = str(value).encode()
                changed.notify_all()
            return bytes([OK]) + _fields(str(value).encode())
        if op == CAS:
            key, expected, desired = fields[0].decode(), fields[1], fields[2]
            with changed:
                current = data.get(key)
                if (current is None and expected == b"") or current == expected:
                    data[key] = current = desired
                    changed.notify_all()
            return bytes([OK]) + _fields(current if current is not None else expected)
        if op == CHECK:
            with changed:
                found = all(k.decode() in data for k in fields)
            return bytes([OK]) + _fields(b"1" if found else b"0")
        if op == DELETE:
            with changed:
                found = data.pop(fields[0].decode(), None) is not None
            return bytes([OK]) + _fields(b"1" if found else b"0")
        if op == NUM_KEYS:
            with changed:
                return bytes([OK]) + _fields(str(len(data)).encode())
        if op == APPEND:
            key = fields[0].decode()
            with changed:
                data[key] = data.get(key, b"") + fields[1]
                changed.notify_all()
            return bytes([OK])
        if op == MULTI_SET:
            if len(fields) % 2:
                raise ValueError("keys without values")
            with changed:
                for key, value in zip(fields[::2], fields[1::2], strict=True):
                    data[key.decode()] = value
                changed.notify_all()
            return bytes([OK])
        raise ValueError(f"no operation {op}")


# -- a client (every process of the run, fast join, fast stop) -------------------------------------------------------
def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


_held: set[RunStore] = set()  # connections torch's groups stand on (RunStore.for_group)


class TimedOut(dist.DistStoreError):
    """A wait of the run's store passed its timeout."""


class RunStore(dist.Store):
    """A connection to the run's store at (`host`, `port`), proved with `secret`; its waits give up after `timeout_s`
    and connecting after `connect_s` (at most `timeout_s`). Raises Refused when the other side is not the run's store
    or does not take the secret, and DistNetworkError when nothing answers. With `interrupted` set (a live group's
    connection, fast.runtime.membership), a wait also gives up as soon as `interrupted()` says why."""

    interrupted: Callable[[], str | None] | None = None
    _for_group = False  # (for_group)

    def __init__(self, host: str, port: int, secret: bytes, timeout_s: float, connect_s: float | None = None) -> None:
        super().__init__()
        self.host, self.port, self._secret = host, port, secret
        self._lock = threading.Lock()
        self.set_timeout(timedelta(seconds=timeout_s))
        connect_s = min(timeout_s, connect_s or timeout_s)
        try:
            sock = socket.create_connection((host, port), timeout=connect_s)
        except OSError as e:
            answer = e.strerror or str(e)
            raise dist.DistNetworkError(f"the run's store at {host}:{port} does not answer ({answer})") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._channel = self._handshake(sock)
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise

    def _handshake(self, sock: socket.socket) -> _Channel:
        where = f"{self.host}:{self.port}"
        try:
            hello = _exactly(sock, len(MAGIC) + NONCE)
            if hello[: len(MAGIC)] != MAGIC:
                raise Refused(f"what answers at {where} is not a FAST run's store")
            server_nonce, client_nonce = hello[len(MAGIC) :], os.urandom(NONCE)
            sock.sendall(client_nonce + _tag(self._secret, b"fast run store client", server_nonce, client_nonce))
            verdict = _exactly(sock, 1)
            if verdict != b"\x01":
                raise Refused(f"the run's store at {where} refused this process: it does not hold the run's secret")
            proof = _exactly(sock, TAG)
        except (OSError, ConnectionError) as e:
            raise Refused(f"the run's store at {where} closed the connection ({e}): wrong secret, or not a run's "
                          "store") from None  # fmt: skip
        if not hmac.compare_digest(proof, _tag(self._secret, b"fast run store server", client_nonce, server_nonce)):
            raise Refused(f"what answers at {where} does not hold the run's secret: it is not the run's store")
        return _Channel(sock, _session_key(self._secret, server_nonce, client_nonce), sending=b"C", receiving=b"S")

    def for_group(self, prefix: str) -> dist.PrefixStore:
        """This connection under `prefix`, for a torch process group to form and live on. torch holds only the C++
        side of a store, and its operations are on the Python side: this connection is kept alive until `close`.
        Its waits last this connection's own timeout, whatever torch asks: torch asks with the group's timeout,
        which a live group's gloo keeps to a fifth of its connect time (fast.comm.comm.connect_timeout)."""
        _held.add(self)
        self._for_group = True
        return dist.PrefixStore(prefix, self)

    def close(self) -> None:
        _held.discard(self)
        with contextlib.suppress(OSError):
            self._channel.sock.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _call(self, op: int, *fields: bytes, waiting: str = "") -> list[bytes]:
        with self._lock:
            try:
                self._channel.send(bytes([op]) + _fields(*fields))
                answer = self._channel.receive()
            except (OSError, ConnectionError, struct.error) as e:
                raise dist.DistNetworkError(f"the run's store at {self.host}:{self.port} is gone ({e})") from None
        if not answer or answer[0] == BAD:
            raise dist.DistStoreError("the run's store refused a malformed operation")
        if answer[0] == TIMEOUT:
            raise TimedOut(f"timed out waiting for {waiting}")
        return _parse(answer, 1)

    def _wait(self, op: int, timeout: timedelta | None, *fields: bytes, waiting: str) -> list[bytes]:
        """`op`, which waits for keys, giving up after `timeout` (default the store's), or with `interrupted` as soon
        as it says why (asking the server INTERRUPT_POLL_S at a time)."""
        seconds = (timeout if timeout is not None else self.timeout).total_seconds()
        end = time.monotonic() + seconds
        while True:
            left = max(0.0, end - time.monotonic())
            part = left if self.interrupted is None else min(INTERRUPT_POLL_S, left)
            try:
                return self._call(op, str(int(part * 1000)).encode(), *fields, waiting=waiting)
            except TimedOut:
                if part >= left:
                    raise TimedOut(f"timed out after {seconds:g}s waiting for {waiting}") from None
            reason = self.interrupted()
            if reason is not None:
                raise dist.DistStoreError(f"gave up waiting for {waiting}: {reason}")

    # c10d's Store interface
    def set(self, key: str, value: Any) -> None:
        self._call(SET, key.encode(), _bytes(value))

    def get(self, key: str) -> bytes:
        return self._wait(GET, None, key.encode(), waiting=key)[0]

    def add(self, key: str, amount: int) -> int:
        return int(self._call(ADD, key.encode(), str(int(amount)).encode())[0])

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call(CAS, key.encode(), _bytes(expected), _bytes(desired))[0]

    def check(self, keys: list[str]) -> bool:
        return self._call(CHECK, *(k.encode() for k in keys))[0] == b"1"

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait(WAIT, None if self._for_group else timeout, *(k.encode() for k in keys), waiting=", ".join(keys))

    def delete_key(self, key: str) -> bool:
        return self._call(DELETE, key.encode())[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(NUM_KEYS)[0])

    def append(self, key: str, value: Any) -> None:
        self._call(APPEND, key.encode(), _bytes(value))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait(MULTI_GET, None, *(k.encode() for k in keys), waiting=", ".join(keys))

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._call(MULTI_SET, *(part for k, v in zip(keys, values, strict=True) for part in (k.encode(), _bytes(v))))

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> RunStore:
        return RunStore(self.host, self.port, self._secret, self.timeout.total_seconds())
