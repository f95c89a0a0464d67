"""Cheap attacks that once froze the whole server or starved its other clients (issue 47), against
the real server (uvicorn + httpx, raw sockets for what no HTTP client sends) on a tiny random
Llama: each attacker gets a 4xx or its connection closed, and ``/health`` keeps answering.

* a body whose check was quadratic (escaped quotes) and froze the event loop for minutes;
* tokenizing in a preparation thread held the GIL; the preparation queue was unbounded, first
  come first served, and one client could fill it;
* a header line without an end was buffered whole; idle and slow connections (slow-loris) stayed
  open for ever, until the descriptors ran out; a client leaving mid-upload logged a traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time

import httpx
import pytest

from tokenbudget import AsyncLLM
from tokenbudget.engine.serve.limits import ServerLimits

from serve_fixtures import KEY, running_server, wait_idle  # noqa: E402
from tiny_llama import make_tiny_llama  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
SLOW = 0.5  # seconds: the header and body deadlines of the servers here


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> AsyncLLM:
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", layers=1, hidden=32, scale=25.0)
    return AsyncLLM(path, num_threads=1, kv_cache_memory_bytes=4 << 20, max_model_len=256)


@pytest.fixture(scope="module")
def served(llm):
    """(base URL, the uvicorn server) with short header and body deadlines."""
    stopper: list = []
    limits = ServerLimits(timeout_headers=SLOW, timeout_body=SLOW, max_preparing_requests=5,
                          max_preparing_per_client=4)
    with running_server(llm, stopper=stopper, limits=limits) as base:
        yield base, stopper[0]


@pytest.fixture
def url(served) -> str:
    return served[0]


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def health_while(url: str, work) -> tuple[float, object]:
    """The longest time without a ``/health`` answer (each a 200) while ``work()`` ran in a
    thread, and ``work()``'s result. The server runs in this process: a frozen event loop freezes
    the poller too, so a freeze shows as a long gap, never as a client timeout."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(work()))
    answered = [time.perf_counter()]
    thread.start()
    while thread.is_alive() or len(answered) < 2:
        assert httpx.get(f"{url}/health", timeout=60).status_code == 200
        answered.append(time.perf_counter())
        time.sleep(0.01)
    thread.join()
    answered.append(time.perf_counter())
    return max(b - a for a, b in zip(answered, answered[1:])), result[0]


def test_escaped_quotes_body_is_refused_and_health_answers_throughout(url, llm):
    """Not a timed test: the margin is 10x the 0.5 s goal, and the old scan froze it for 27 s
    on this body (64 KB; 4 MiB and every other shape: tests/test_json_depth.py)."""
    body = b'{"prompt": "' + b'\\"' * (32 << 10)
    gap, r = health_while(url, lambda: httpx.post(
        f"{url}{COMPLETIONS}", content=body, headers={**AUTH, "Content-Type": "application/json"}, timeout=120))
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert gap < 5.0


def test_tokenizing_lets_other_threads_run(llm):
    """A long text is tokenized with the GIL released: this thread keeps ticking meanwhile
    (with the GIL held it could not tick at all until the call returned)."""
    text = "1" * (1 << 20)  # ~0.5 s of tokenizing on this vocabulary (one token per byte)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (llm.tokenizer.encode(text), done.set()))
    ticks = 0
    worker.start()
    while not done.is_set():
        time.sleep(0.001)
        ticks += 1
    worker.join()
    assert ticks >= 20


def test_every_text_field_counts_towards_the_prompt_byte_bound(url):
    """A 3 MB chat role was never counted: it was rendered and tokenized before the refusal."""
    r = httpx.post(f"{url}{CHAT}", json={"messages": [{"role": "r" * (3 << 20), "content": "hi"}]},
                   headers=AUTH, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "bytes" in r.json()["error"]["message"]  # the byte bound refused it, before tokenizing


@contextlib.contextmanager
def gated_preparation(server):
    """Every preparation waits for a ``release()`` of the yielded semaphore; the prompts in the
    order their preparation began."""
    app_server = server.config.app.state.server
    gate, started, original = threading.Semaphore(0), [], app_server._prepare

    def waiting(body, chat):
        started.append(json.loads(body)["prompt"])
        gate.acquire()
        return original(body, chat)

    app_server._prepare = waiting
    try:
        yield gate, started, app_server.preparation
    finally:
        app_server._prepare = original
        for _ in range(16):
            gate.release()


def test_preparation_is_bounded_and_takes_clients_in_turn(served):
    """Two preparation threads, at most 5 requests in preparation, 4 per client. Client A sends
    a1..a4, then a5 (429: its share is full), B sends b1, C sends c1 (429: the queue is full).
    Threads free up one at a time: after a1, a2 the turns go a3, b1, a4 (first come first
    served gave a3, a4, b1)."""
    url, server = served
    a = httpx.Client(base_url=url, headers=AUTH, timeout=60)
    b = httpx.Client(base_url=url, headers=AUTH, timeout=60, transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    c = httpx.Client(base_url=url, headers=AUTH, timeout=60, transport=httpx.HTTPTransport(local_address="127.0.0.3"))
    answers: dict[str, int] = {}

    def send(client, prompt):
        answers[prompt] = client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 1}).status_code

    def queued(client, prompt, count):
        threads.append(threading.Thread(target=send, args=(client, prompt)))
        threads[-1].start()
        deadline = time.monotonic() + 30
        while queue.total < count:  # in the queue, in this order
            assert time.monotonic() < deadline
            time.sleep(0.005)

    with gated_preparation(server) as (gate, started, queue):
        threads: list[threading.Thread] = []
        for i, prompt in enumerate(["a1", "a2", "a3", "a4"]):
            queued(a, prompt, i + 1)
        refused_a = a.post(COMPLETIONS, json={"prompt": "a5", "max_tokens": 1})
        queued(b, "b1", 5)
        refused_c = c.post(COMPLETIONS, json={"prompt": "c1", "max_tokens": 1})
        assert refused_a.status_code == 429 and "--max-preparing-per-client=4" in refused_a.json()["error"]["message"]
        assert refused_c.status_code == 429 and "--max-preparing-requests=5" in refused_c.json()["error"]["message"]
        assert refused_a.headers["retry-after"] == "1"
        for _ in range(5):
            gate.release()
        for thread in threads:
            thread.join(60)
    assert started == ["a1", "a2", "a3", "b1", "a4"]
    assert answers == dict.fromkeys(["a1", "a2", "a3", "a4", "b1"], 200)
    assert queue.total == 0 and not queue.per_client


def test_a_request_whose_client_left_leaves_the_preparation_queue(served):
    """Its place is given up at once and it is never prepared (the queue once worked through
    every request a departed attacker had sent)."""
    url, server = served
    with gated_preparation(server) as (gate, started, queue):
        threads = [threading.Thread(target=httpx.post, args=(f"{url}{COMPLETIONS}",),
                                    kwargs={"json": {"prompt": p, "max_tokens": 1}, "headers": AUTH, "timeout": 60})
                   for p in ("x1", "x2")]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while len(started) < 2:  # both threads busy
            assert time.monotonic() < deadline
            time.sleep(0.005)
        body = json.dumps({"prompt": "gone", "max_tokens": 1}).encode()
        with socket.create_connection(address(url)) as leaving:
            leaving.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                            + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                            + b"\r\n\r\n" + body)
            deadline = time.monotonic() + 30
            while queue.total < 3:
                assert time.monotonic() < deadline
                time.sleep(0.005)
        deadline = time.monotonic() + 30
        while queue.total > 2:  # it left: its place is given up before any thread is free
            assert time.monotonic() < deadline
            time.sleep(0.005)
        gate.release()
        gate.release()
        for thread in threads:
            thread.join(60)
    assert sorted(started) == ["x1", "x2"]


def read_all(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """What the server sends until it closes the connection (or ``timeout`` passes)."""
    sock.settimeout(timeout)
    chunks = []
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_an_endless_header_line_is_refused_after_a_bounded_buffer(url):
    """uvicorn with httptools buffered a header line whole, however long (64 MB held 64 MB)."""
    with socket.create_connection(address(url)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: ")
        sent = 0
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent < 32 << 20:  # the server answers and closes long before
                sock.sendall(b"a" * 65536)
                sent += 65536
        reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 400") and sent < 32 << 20


def test_idle_and_slow_connections_get_408_and_are_closed(url, llm):
    """Slow-loris: a connection that sends nothing, one that trickles header lines, one whose
    body stops a byte short; each is answered 408 once its deadline passes."""
    idle = socket.create_connection(address(url))
    trickle = socket.create_connection(address(url))
    short = socket.create_connection(address(url))
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    short.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body[:-1])
    trickle.sendall(b"GET /health HTTP/1.1\r\n")
    with contextlib.suppress(OSError):
        for _ in range(int(4 * SLOW / 0.1)):
            trickle.sendall(b"X-A: b\r\n")
            time.sleep(0.1)
    replies = [read_all(sock) for sock in (idle, trickle, short)]
    for sock in (idle, trickle, short):
        sock.close()
    assert replies[0].startswith(b"HTTP/1.1 408") and replies[1].startswith(b"HTTP/1.1 408")
    assert replies[2].startswith(b"HTTP/1.1 408") and b"--timeout-body" in replies[2]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    wait_idle(llm)


def test_past_max_connections_the_slowest_is_closed_and_health_answers(llm):
    """Sixty connections against a cap of 16 (deadlines far away): thirty whose body stops a
    byte short (their request is in the app), then thirty idle. The oldest of those still
    sending are closed with a 408 to make room, and a probe always gets in."""
    limits = ServerLimits(max_connections=16, timeout_headers=600, timeout_body=600)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n" + b" " * 99)
    with running_server(llm, limits=limits) as base:
        stalled = []
        for i in range(60):
            stalled.append(socket.create_connection(address(base)))
            if i < 30:
                stalled[-1].sendall(head)
                time.sleep(0.01)  # its headers are in before the next one connects
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        replies = [read_all(sock, timeout=5) for sock in stalled[:40]]
        assert all(reply.startswith(b"HTTP/1.1 408") for reply in replies)
        for sock in stalled:
            sock.close()
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200


def test_a_client_leaving_mid_upload_costs_one_log_line(url):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("tokenbudget", "uvicorn.error")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        with socket.create_connection(address(url)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                         + b"\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n" + b"{" * 100)
            time.sleep(0.1)
        deadline = time.monotonic() + 10
        while not any("disconnected" in r.getMessage() for r in records) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # anything else it would log
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
    assert len(records) == 1 and records[0].exc_info is None, [r.getMessage() for r in records]
    assert "100 bytes" in records[0].getMessage()
