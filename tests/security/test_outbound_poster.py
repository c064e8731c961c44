"""The Poster's HTTP/1.1 against a raw server on 127.0.0.1: keep-alive, framing, and when a connection is not reused.

The server answers each request with scripted bytes and counts the TCP connections it
accepted, so a test sees whether the Poster reused its connection. The policy tests (refused
targets, TLS names, timeouts) run with the Poster in test_outbound_client.py.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable

import httpx
import pytest

from hardcount import outbound


class RawServer:
    """Answers the n-th request (from 1, all connections) with ``answer(n)``; ``close_after(n)`` then hangs up."""

    def __init__(self, answer: Callable[[int], bytes], *, close_after: Callable[[int], bool] = lambda n: False):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.bodies: list[bytes] = []
        self.heads: list[bytes] = []
        self._answer, self._close_after = answer, close_after
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        buffer = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                length = next(int(h.split(b":", 1)[1]) for h in lines if h.lower().startswith(b"content-length:"))
                while len(buffer) < length:
                    buffer += conn.recv(65536)
                body, buffer = buffer[:length], buffer[length:]
                with self._lock:
                    self.heads.append(head)
                    self.bodies.append(body)
                    n = len(self.bodies)
                conn.sendall(self._answer(n))
                if self._close_after(n):
                    return

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def raw_server(allow):
    made: list[RawServer] = []

    def make(answer, **kwargs) -> RawServer:
        server = RawServer(answer, **kwargs)
        allow(f"127.0.0.1:{server.port}")
        made.append(server)
        return server

    yield make
    for server in made:
        server.close()


def post_many(url: str, bodies: list[bytes], **kwargs) -> list[outbound.Answer | BaseException]:
    """POST each body in turn through one Poster; the answers (or the exceptions raised)."""

    async def run():
        results = []
        async with outbound.Poster(connect_timeout_s=2.0) as poster:
            for body in bodies:
                try:
                    async with asyncio.timeout(3):
                        results.append(await poster.post(url, body, {"Hardcount-Attempt": "1"}, **kwargs))
                except (httpx.HTTPError, TimeoutError) as exc:
                    results.append(exc)
        return results

    return asyncio.run(run())


def ok(body: bytes = b"ok", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body


def test_one_connection_carries_every_request_and_each_is_framed(raw_server):
    server = raw_server(lambda n: ok(f"answer {n}".encode()))
    answers = post_many(server.url("/hook?x=1"), [b'{"n": 1}', b'{"n": 2}', b'{"n": 3}'])
    assert [(a.status_code, a.excerpt) for a in answers] == [(200, b"answer 1"), (200, b"answer 2"), (200, b"answer 3")]
    assert server.connections == 1
    assert server.bodies == [b'{"n": 1}', b'{"n": 2}', b'{"n": 3}']
    first = server.heads[0].split(b"\r\n")
    assert first[0] == b"POST /hook?x=1 HTTP/1.1"
    assert f"Host: 127.0.0.1:{server.port}".encode() in first and b"Hardcount-Attempt: 1" in first


def test_connection_close_is_honoured(raw_server):
    server = raw_server(lambda n: ok(extra=b"Connection: close\r\n"), close_after=lambda n: True)
    answers = post_many(server.url(), [b"1", b"2"])
    assert [a.status_code for a in answers] == [200, 200]
    assert server.connections == 2


def test_chunked_answers_are_read_to_their_end_and_the_connection_kept(raw_server):
    chunked = (
        b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\nRetry-After: 30\r\n\r\n"
        b"3;x=y\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    server = raw_server(lambda n: chunked)
    answers = post_many(server.url(), [b"1", b"2"])
    assert [(a.status_code, a.excerpt, a.headers["retry-after"]) for a in answers] == [(500, b"abcde", "30")] * 2
    assert server.connections == 1


def test_interim_answers_are_skipped(raw_server):
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n"
    server = raw_server(lambda n: interim + ok(b"done"))
    (answer,) = post_many(server.url(), [b"1"])
    assert (answer.status_code, answer.excerpt) == (200, b"done")


def test_a_long_body_gives_its_first_bytes_as_the_excerpt(raw_server):
    server = raw_server(lambda n: ok(b"x" * 5000 + b"y"))
    (answer,) = post_many(server.url(), [b"1"], excerpt_bytes=1024)
    assert (answer.status_code, answer.excerpt) == (200, b"x" * 1024)


def test_an_answer_delimited_by_its_end_is_read_and_its_connection_not_reused(raw_server):
    unframed = b"HTTP/1.1 200 OK\r\n\r\nuntil the end"
    server = raw_server(lambda n: unframed if n == 1 else ok(), close_after=lambda n: n == 1)
    answers = post_many(server.url(), [b"1", b"2"])
    assert (answers[0].status_code, answers[0].excerpt) == (200, b"until the end")
    assert answers[1].status_code == 200
    assert server.connections == 2


def test_a_connection_dropped_without_an_answer_is_an_error_not_a_retry(raw_server):
    server = raw_server(lambda n: b"" if n == 1 else ok(), close_after=lambda n: n == 1)
    answers = post_many(server.url(), [b"1", b"2"])
    assert isinstance(answers[0], httpx.RemoteProtocolError)
    assert answers[1].status_code == 200
    assert len(server.bodies) == 2  # the first request was sent once, never repeated behind the caller's back


def test_a_header_with_a_line_break_is_refused_before_sending(raw_server):
    server = raw_server(lambda n: ok())

    async def run():
        async with outbound.Poster(connect_timeout_s=2.0) as poster:
            with pytest.raises(httpx.LocalProtocolError):
                await poster.post(server.url(), b"1", {"X": "a\r\nInjected: yes"})

    asyncio.run(run())
    assert server.bodies == []
