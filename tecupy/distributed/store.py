"""A small TCP key-value store: how the ranks of a job find each other before NCCL can.

Rank 0 serves it (StoreServer, threads of rank 0's process) at MASTER_ADDR:MASTER_PORT;
every rank, rank 0 included, talks to it through a Store client. It carries NCCL's unique
id, the arrival of each rank (so an initialisation timeout names the ranks that did not
come), and the job's abort: the first reason posted under ABORT wins, every blocking call
returns at once with it, and each rank's watchdog (nccl.py) blocks on it.

Wire: each message is a 4-byte big-endian length and a JSON object. Values are bytes
(base64 on the wire); nothing is unpickled, so a stray connection cannot run code.
A connection that closes without saying "bye" after naming its rank (a process killed or
crashed) aborts the job: "rank r lost its connection to the store ...".
"""
import base64
import json
import socket
import struct
import threading
import time

from .group import GroupAborted

ABORT = "abort"
_HEADER = struct.Struct(">I")


class StoreTimeout(TimeoutError):
    """A store wait ran past its timeout; the message names what (and who) was missing."""


class StoreLost(ConnectionError):
    """The store's server (rank 0) went away."""


def _send(sock, obj):
    data = json.dumps(obj).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv(sock):
    head = _recv_exact(sock, _HEADER.size)
    return None if head is None else json.loads(_recv_exact(sock, _HEADER.unpack(head)[0]))


def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _enc(value):
    if isinstance(value, str):
        value = value.encode()
    return base64.b64encode(bytes(value)).decode()


def _dec(text):
    return base64.b64decode(text)


def _spoke(conn):
    """True when the peer sent more (or closed) while its request waits."""
    try:
        conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        return True
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


class StoreServer:
    """Serves the store on (host, port) from daemon threads of this process; port 0 picks a
    free one (.port)."""

    def __init__(self, host="0.0.0.0", port=0):
        self._data, self._cond = {}, threading.Condition()
        self._conns = {}  # socket -> rank it named (None before hello)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise OSError(f"tecupy store: cannot serve on {host}:{port} ({e}); is "
                          "MASTER_PORT taken by another job?") from e
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="tecupy-store").start()

    def _accept(self):
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._cond:
                self._conns[conn] = None
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="tecupy-store-conn").start()

    def _serve(self, conn):
        clean = False
        try:
            while True:
                msg = _recv(conn)
                if msg is None:
                    break
                if msg["op"] == "bye":
                    clean = True
                    break
                reply = self._handle(conn, msg)
                if reply is not None:
                    _send(conn, reply)
        except (OSError, ValueError):
            pass
        finally:
            with self._cond:
                rank = self._conns.pop(conn, None)
                if not clean and rank is not None and not self._closed:
                    self._data.setdefault(ABORT, _enc(
                        f"rank {rank} lost its connection to the store without closing it "
                        "(its process was killed or crashed)"))
                self._cond.notify_all()
            conn.close()

    def _handle(self, conn, msg):
        op, d = msg["op"], self._data
        with self._cond:
            if op == "hello":
                self._conns[conn] = msg["rank"]
                return {}
            if op == "set":
                if msg.get("first"):
                    d.setdefault(msg["key"], msg["value"])
                else:
                    d[msg["key"]] = msg["value"]
                self._cond.notify_all()
                return {"value": d[msg["key"]]}
            if op == "add":
                d[msg["key"]] = _enc(str(int(_dec(d.get(msg["key"], _enc("0")))) + msg["n"]))
                self._cond.notify_all()
                return {"value": d[msg["key"]]}
            if op == "wait":  # until every key is set, the abort is, or the timeout passes
                keys, timeout = msg["keys"], msg["timeout"]
                end = None if timeout is None else time.monotonic() + timeout
                while True:
                    missing = [k for k in keys if k not in d]
                    if not missing or (ABORT in d and msg.get("abortable", True)):
                        break
                    left = None if end is None else end - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    if _spoke(conn):  # a client that waits can only say bye, or vanish
                        return None
                    self._cond.wait(0.2 if left is None else min(left, 0.2))
                return {"missing": missing, "values": [d.get(k) for k in keys],
                        "abort": d.get(ABORT)}
            raise ValueError(f"tecupy store: unknown op {op!r}")

    def clients(self):
        """How many connections are open."""
        with self._cond:
            return len(self._conns)

    def wait_clients_closed(self, timeout, own=0):
        """Wait until at most `own` connections (this process's) are open, or `timeout`."""
        end = time.monotonic() + timeout
        with self._cond:
            while len(self._conns) > own and time.monotonic() < end:
                self._cond.wait(min(0.1, max(end - time.monotonic(), 0)))

    def close(self):
        with self._cond:
            self._closed = True
            conns = list(self._conns)
        self._sock.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Store:
    """A client of the store at (host, port), for `rank`. Connecting retries until
    `timeout` (rank 0 may start its server after the others start)."""

    def __init__(self, host, port, rank, timeout=60.0):
        self.host, self.port, self.rank = host, port, rank
        self._lock = threading.Lock()
        end = time.monotonic() + timeout
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError as e:
                if time.monotonic() >= end:
                    raise StoreTimeout(
                        f"rank {rank}: no store at {host}:{port} after {timeout:g} s ({e}): "
                        "rank 0, which serves it, did not start (or has ended, or "
                        "MASTER_ADDR/MASTER_PORT differ between the ranks)") from None
                time.sleep(0.05)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._call({"op": "hello", "rank": rank})

    def _call(self, msg):
        with self._lock:
            try:
                _send(self._sock, msg)
                reply = _recv(self._sock)
            except OSError:
                reply = None
        if reply is None:
            raise StoreLost(f"rank {self.rank}: lost the store at {self.host}:{self.port} "
                            "(rank 0 exited or crashed)")
        return reply

    def set(self, key, value, first=False):
        """Set key to value (bytes or str); first=True keeps an existing value. -> the
        value now stored."""
        return _dec(self._call({"op": "set", "key": key, "value": _enc(value),
                                "first": first})["value"])

    def add(self, key, n=1):
        """Atomically add n to the integer at key (0 if unset); -> the new value."""
        return int(_dec(self._call({"op": "add", "key": key, "n": n})["value"]))

    def wait(self, keys, timeout=None, abortable=True):
        """Wait for every key; -> their values. StoreTimeout lists the missing keys
        (.missing); GroupAborted if the job aborts first (unless abortable=False)."""
        r = self._call({"op": "wait", "keys": list(keys), "timeout": timeout,
                        "abortable": abortable})
        if r["missing"] and r["abort"] is not None and abortable:
            raise GroupAborted(_dec(r["abort"]).decode())
        if r["missing"]:
            err = StoreTimeout(f"rank {self.rank}: store keys {r['missing']} not set within "
                               f"{timeout:g} s")
            err.missing = r["missing"]
            raise err
        return [_dec(v) for v in r["values"]]

    def get(self, key, timeout=None):
        return self.wait([key], timeout)[0]

    def abort(self, reason):
        """Post the job's abort (the first reason posted wins); -> the reason that won."""
        return self.set(ABORT, reason, first=True).decode()

    def aborted(self):
        """The job's abort reason, or None (does not wait)."""
        r = self._call({"op": "wait", "keys": [ABORT], "timeout": 0, "abortable": False})
        return None if r["missing"] else _dec(r["values"][0]).decode()

    def watch_abort(self):
        """Block until the job aborts (-> its reason); StoreLost if the server goes."""
        return self.wait([ABORT], None, abortable=False)[0].decode()

    def close(self):
        """Say bye (a clean exit, not a crash) and close."""
        try:  # (not under the lock: a watchdog may be blocked in watch_abort)
            _send(self._sock, {"op": "bye"})
        except OSError:
            pass
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
