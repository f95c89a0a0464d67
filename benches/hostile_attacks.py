"""The attacks of issue 47 against a running ``tokenbudget serve``, for ``benches/hostile_serve.py``.

Each attack is a function ``(addr, sockets) -> outcome``: it opens its connections with raw
sockets (registered in ``sockets``, so the harness can cut them all at the end of its window:
a shut-down socket wakes a blocked read) and returns what the attacker got (HTTP statuses, or
how its connections ended). Raw sockets because several attacks send what no HTTP client
sends (an endless header line, a body that stops a byte short) and because the harness must
stop them at once whatever they wait for.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections import Counter

KEY_HEADERS = b"Host: bench\r\nContent-Type: application/json\r\n"


class Sockets(list):
    """The attack's sockets; once ``stopped`` (the harness cut them) it opens no more."""

    stopped = False


def _connect(addr, sockets: Sockets) -> socket.socket:
    if sockets.stopped:
        raise OSError("the attack was stopped")
    sock = socket.create_connection(addr)
    sockets.append(sock)
    return sock


def _status(sock: socket.socket) -> str:
    """The status of the response on ``sock`` ("closed" when it closed without one)."""
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                return "closed"
            data += chunk
    except OSError:
        return "closed"
    return data.split(b" ", 2)[1].decode()


def post(addr, sockets: list, path: str, body: bytes) -> str:
    """One POST; its status (or "closed")."""
    try:
        sock = _connect(addr, sockets)
        sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\n" + KEY_HEADERS + b"Content-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
    except OSError:
        return "refused"
    return _status(sock)


def in_threads(count: int, work) -> Counter:
    """``work(i)`` in ``count`` threads; the Counter of what they returned."""
    results: list = []
    threads = [threading.Thread(target=lambda i=i: results.append(work(i)), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Counter(results)


# ------------------------------------------------------------------------------ the attacks
def escaped_quotes(addr, sockets, size: int = 64 << 10, clients: int = 4) -> Counter:
    """Bodies ``{"prompt": "\\"\\"\\"...`` (a string that never closes), ``clients`` at a time."""
    body = b'{"prompt": "' + b'\\"' * (size // 2)
    return in_threads(clients, lambda i: post(addr, sockets, "/v1/completions", body))


def tokenize(addr, sockets, prompt_bytes: int, clients: int = 20, each: int = 3) -> Counter:
    """``clients`` x ``each`` completions of ``prompt_bytes`` digits: one token per digit, just
    inside the byte bound, so each is tokenized before its 400."""
    body = json.dumps({"prompt": "1" * prompt_bytes, "max_tokens": 1}).encode()
    return in_threads(clients, lambda i: tuple(post(addr, sockets, "/v1/completions", body) for _ in range(each)))


def chat_role(addr, sockets, clients: int = 10) -> Counter:
    """Chats whose ``role`` is 3.9 MB (a field the byte bound did not count)."""
    body = json.dumps({"messages": [{"role": "r" * 3_900_000, "content": "hi"}], "max_tokens": 1}).encode()
    return in_threads(clients, lambda i: post(addr, sockets, "/v1/chat/completions", body))


def grammar_pile_up(addr, sockets, children: tuple[int, ...] = (16, 16, 16, 14)) -> Counter:
    """62 structured children with the pattern ``a{40000}`` (~8 ms a mask), 120 tokens each."""
    def one(i):
        body = json.dumps({"messages": [{"role": "user", "content": "Write a's"}], "max_tokens": 120,
                           "n": children[i], "temperature": 1.0, "response_format": {
                               "type": "json_schema", "json_schema": {"name": "a", "schema": {
                                   "type": "string", "pattern": "^a{40000}$"}}}}).encode()
        return post(addr, sockets, "/v1/chat/completions", body)
    return in_threads(len(children), one)


def endless_header(addr, sockets, connections: int = 8, size: int = 64 << 20) -> Counter:
    """``connections`` x one header line of ``size`` bytes without a newline."""
    def one(i):
        sock = _connect(addr, sockets)
        chunk, sent = b"a" * (1 << 20), 0
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: bench\r\nX-Long: ")
            while sent < size:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            return f"cut after <= {sent >> 20} MB: {_status(sock)}"
        return "all sent; " + _status(sock)
    return in_threads(connections, one)


def slow_loris(addr, sockets, per_variant: int = 200, uploads: int = 40, hold: float = 35.0) -> Counter:
    """Four variants x ``per_variant`` connections (idle; partial headers, a line a second;
    headers one byte a second; a body one byte short) and ``uploads`` uploads stalled one byte
    short of 4 MiB, all held ``hold`` seconds: how many the server closed by then."""
    body = b"x" * 100
    short_head = b"POST /v1/completions HTTP/1.1\r\n" + KEY_HEADERS + b"Content-Length: 100\r\n\r\n"
    upload_head = b"POST /v1/completions HTTP/1.1\r\n" + KEY_HEADERS + b"Content-Length: " + str(4 << 20).encode() \
        + b"\r\n\r\n"
    opened: dict[str, list[socket.socket]] = {k: [] for k in ("idle", "partial", "trickle", "short-body", "upload")}
    start = time.monotonic()
    for kind, count in (("idle", per_variant), ("partial", per_variant), ("trickle", per_variant),
                        ("short-body", per_variant), ("upload", uploads)):
        for _ in range(count):
            try:
                sock = _connect(addr, sockets)
                if kind == "partial":
                    sock.sendall(b"GET /health HTTP/1.1\r\n")
                elif kind == "short-body":
                    sock.sendall(short_head + body[:-1])
                elif kind == "upload":
                    sock.sendall(upload_head + b"u" * ((4 << 20) - 1))
            except OSError:
                continue
            opened[kind].append(sock)
    step = 0
    while time.monotonic() - start < hold:
        step += 1
        for kind, line in (("partial", b"X-A: b\r\n"), ("trickle", b"G" if step == 1 else b"x")):
            for sock in opened[kind]:
                try:
                    sock.sendall(line)
                except OSError:
                    pass
        time.sleep(1.0)
    outcome = Counter()
    for kind, socks in opened.items():
        closed = sum(1 for s in socks if _closed(s))
        outcome[f"{kind}: {closed}/{len(socks)} closed by the server"] += 1
    return outcome


def _closed(sock: socket.socket) -> bool:
    """The server has answered or closed (the socket reads without blocking)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


ATTACKS = {
    "escaped-quotes": escaped_quotes,
    "tokenize": tokenize,
    "chat-role": chat_role,
    "grammar": grammar_pile_up,
    "header": endless_header,
    "slow-loris": slow_loris,
}
