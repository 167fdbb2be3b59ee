"""Many HTTP GETs at once on one thread, each under a hard deadline: the scraper's transport.

Why not a client library: a per-read timeout (what ``requests`` offers) never fires for a
server that drips one byte every half second, and a thread per target does not scale to a
thousand targets. Here every exchange is a small generator over a non-blocking socket that
yields what it waits for; one ``selectors`` loop drives them all, so a slow target only ever
costs its own deadline, which covers resolving, connecting, TLS, the request, the headers, the
body and (through ``on_done``, called on the loop thread) whatever the caller does with it.

What is spoken: HTTP/1.1 ``GET``; a body by ``Content-Length``, chunked, or up to the close;
``Content-Encoding: gzip`` (prometheus_client's). With a :class:`ConnectionPool` (the scraper
keeps one for its lifetime) a connection the server keeps open (HTTP/1.1, a framed body, no
``Connection: close``) is kept for the next round, so a round over a thousand targets does not
open a thousand connections; a kept connection the server has closed meanwhile is replaced once,
within the same deadline. Without a pool, ``Connection: close``. Redirects are
not followed (kind ``redirect``): a metrics URL that moved is a configuration to fix, and
following it would let a target send the scraper anywhere. The body is capped before and after
decompression (kind ``too_large``). Host names are resolved on a small thread pool, so a slow
resolver does not hold the loop either.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import selectors
import socket
import ssl
import time
import zlib
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 * 1024
MAX_IN_FLIGHT = 512  # sockets open at once; further targets start as others finish (fd limits)
RECV_BYTES = 65536
USER_AGENT = "prefixscope"

_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
Wait = tuple[socket.socket, int] | Future


class FetchFailed(Exception):
    """One target's exchange failed; ``kind`` is the ingest-error kind it is counted under."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


PoolKey = tuple[str, str, int]  # scheme, host, port


class ConnectionPool:
    """Idle kept-alive connections by (scheme, host, port), between rounds; at most ``max_idle``."""

    def __init__(self, max_idle: int = 4096) -> None:
        self.max_idle = max_idle
        self._idle: dict[PoolKey, list[socket.socket]] = {}
        self._count = 0

    def take(self, key: PoolKey) -> socket.socket | None:
        socks = self._idle.get(key)
        if not socks:
            return None
        self._count -= 1
        return socks.pop()

    def put(self, key: PoolKey, sock: socket.socket) -> None:
        if self._count >= self.max_idle:
            sock.close()
            return
        self._idle.setdefault(key, []).append(sock)
        self._count += 1

    def __len__(self) -> int:
        return self._count

    def close(self) -> None:
        for socks in self._idle.values():
            for sock in socks:
                sock.close()
        self._idle.clear()
        self._count = 0


class _Stale(Exception):
    """A kept connection the server closed while it was idle: open a new one."""


@dataclass(slots=True)
class _Job:
    index: int
    url: str
    deadline: float
    phase: str = "resolving the host"
    sock: socket.socket | None = None
    gen: Generator[Wait, None, bytes] | None = None
    waiting: Future | None = None
    registered: int | None = field(default=None)  # the fd registered with the selector
    key: PoolKey | None = None  # set when the connection may be kept (a pool was given)
    keep: bool = False  # the exchange ended with the connection reusable


_resolver: ThreadPoolExecutor | None = None
_tls: ssl.SSLContext | None = None


def _default_tls() -> ssl.SSLContext:
    global _tls
    if _tls is None:
        _tls = ssl.create_default_context()
    return _tls


def _resolve(host: str, port: int) -> Future:
    global _resolver
    if _resolver is None:
        _resolver = ThreadPoolExecutor(max_workers=4, thread_name_prefix="prefixscope-resolve")
    return _resolver.submit(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)


def fetch_all(urls: Sequence[str], timeout: float, max_body: int, accept: str,
              on_done: Callable[[int, bytes | FetchFailed, float], None],
              tls: ssl.SSLContext | None = None, pool: ConnectionPool | None = None) -> None:
    """GET every URL; call ``on_done(index, body or failure, deadline)`` once for each, as each ends.

    Each target has ``timeout`` seconds from the moment its connection starts (at once for the
    first ``MAX_IN_FLIGHT``). ``on_done`` runs on this thread and may use the deadline it is given.
    With ``pool``, connections are taken from it and those the server keeps open go back to it.
    """
    sel = selectors.DefaultSelector()
    queued = list(enumerate(urls))[::-1]
    # Jobs in the order they started, which is the order of their deadlines (each is its start
    # plus ``timeout``): the next deadline is the first job's, and expired jobs are a prefix.
    active: dict[int, _Job] = {}
    resolving: dict[int, _Job] = {}  # jobs waiting for a host name to resolve

    def finish(job: _Job, result: bytes | FetchFailed) -> None:
        active.pop(job.index, None)
        resolving.pop(job.index, None)
        if job.registered is not None:
            sel.unregister(job.registered)
            job.registered = None
        if job.sock is not None:
            if pool is not None and job.keep and job.key is not None and not isinstance(result, FetchFailed):
                pool.put(job.key, job.sock)
            else:
                job.sock.close()
            job.sock = None
        if job.gen is not None:
            job.gen.close()
        on_done(job.index, result, job.deadline)

    def advance(job: _Job) -> None:
        try:
            want = job.gen.send(None)  # type: ignore[union-attr]
        except StopIteration as done:
            return finish(job, done.value)
        except FetchFailed as exc:
            return finish(job, exc)
        except (OSError, ValueError) as exc:
            return finish(job, FetchFailed("connect", f"{type(exc).__name__}: {exc}"))
        if isinstance(want, Future):
            job.waiting = want
            resolving[job.index] = job
            return None
        sock, events = want
        fd = sock.fileno()
        if job.registered == fd:
            sel.modify(fd, events, job)
        else:
            if job.registered is not None:
                sel.unregister(job.registered)
            sel.register(fd, events, job)
            job.registered = fd
        return None

    try:
        while queued or active:
            while queued and len(active) < MAX_IN_FLIGHT:
                index, url = queued.pop()
                job = _Job(index, url, time.monotonic() + timeout)
                job.gen = _exchange(job, url, max_body, accept, tls, pool)
                active[index] = job
                advance(job)
            if not active:
                continue
            now = time.monotonic()
            expired = []
            for j in active.values():
                if j.deadline > now:
                    break
                expired.append(j)
            for job in expired:
                finish(job, FetchFailed("timeout", f"no complete answer within {timeout:g}s ({job.phase})"))
            if not active:
                continue
            wait = next(iter(active.values())).deadline - now
            if resolving:
                wait = min(wait, 0.01)
            for key, _events in sel.select(max(0.0, wait)):
                job = key.data
                if job.index in active:
                    advance(job)
            for job in [j for j in resolving.values() if j.waiting is not None and j.waiting.done()]:
                del resolving[job.index]
                job.waiting = None
                advance(job)
    finally:
        for job in list(active.values()):
            finish(job, FetchFailed("timeout", "scrape round abandoned"))
        sel.close()


# ---- one exchange, written as if blocking ---------------------------------------------------
def _recv(sock: socket.socket) -> Generator[Wait, None, bytes]:
    while True:
        try:
            return sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            yield sock, _READ
        except ssl.SSLWantWriteError:
            yield sock, _WRITE
        except ssl.SSLZeroReturnError:
            return b""


def _send_all(sock: socket.socket, data: bytes) -> Generator[Wait, None, None]:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
            yield sock, _WRITE
        except ssl.SSLWantReadError:
            yield sock, _READ


class _Buffer:
    """Received bytes not yet consumed, with reads that wait for more."""

    def __init__(self, sock: socket.socket, data: bytes = b"") -> None:
        self.sock = sock
        self.data = bytearray(data)
        self.eof = False

    def more(self) -> Generator[Wait, None, bool]:
        chunk = yield from _recv(self.sock)
        if not chunk:
            self.eof = True
            return False
        self.data += chunk
        return True

    def line(self, limit: int) -> Generator[Wait, None, bytes]:
        start = 0
        while (end := self.data.find(b"\r\n", start)) < 0:
            if len(self.data) > limit:
                raise FetchFailed("garbage", f"a chunk-size line longer than {limit} bytes")
            start = max(0, len(self.data) - 1)
            if not (yield from self.more()):
                raise FetchFailed("connect", "connection closed inside a chunked body")
        out = bytes(self.data[:end])
        del self.data[:end + 2]
        return out

    def exact(self, n: int) -> Generator[Wait, None, bytes]:
        while len(self.data) < n:
            if not (yield from self.more()):
                raise FetchFailed("connect", f"connection closed {n - len(self.data)} bytes before the body ended")
        out = bytes(self.data[:n])
        del self.data[:n]
        return out


def _address(job: _Job, host: str, port: int) -> Generator[Wait, None, tuple]:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        future = _resolve(host, port)
        yield future
        try:
            infos = future.result()
        except OSError as exc:
            raise FetchFailed("connect", f"cannot resolve {host}: {exc}") from None
        family, _, _, _, addr = infos[0]
        return family, addr
    return (socket.AF_INET6 if ip.version == 6 else socket.AF_INET), (host, port)


def _connect(job: _Job, host: str, port: int, https: bool,
             tls: ssl.SSLContext | None) -> Generator[Wait, None, socket.socket]:
    family, addr = yield from _address(job, host, port)
    job.phase = "connecting"
    sock = job.sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    err = sock.connect_ex(addr)
    if err in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
        yield sock, _WRITE
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        raise FetchFailed("connect", f"{os.strerror(err)} ({host}:{port})")
    if https:
        job.phase = "TLS handshake"
        sock = job.sock = (tls or _default_tls()).wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
        while True:
            try:
                sock.do_handshake()
                break
            except ssl.SSLWantReadError:
                yield sock, _READ
            except ssl.SSLWantWriteError:
                yield sock, _WRITE
            except ssl.SSLError as exc:
                raise FetchFailed("connect", f"TLS: {exc}") from None
    return sock


def _request_and_head(job: _Job, sock: socket.socket, request: bytes,
                      reused: bool) -> Generator[Wait, None, tuple[_Buffer, str]]:
    """Send the request and read the response head; :class:`_Stale` when a kept connection
    turns out closed before any byte of the answer."""
    job.phase = "sending the request"
    try:
        yield from _send_all(sock, request)
    except (ConnectionResetError, BrokenPipeError):
        if reused:
            raise _Stale from None
        raise
    job.phase = "waiting for the headers"
    buf = _Buffer(sock)
    start = 0
    while (end := buf.data.find(b"\r\n\r\n", start)) < 0:
        if len(buf.data) > MAX_HEADER_BYTES:
            raise FetchFailed("too_large", f"headers exceed {MAX_HEADER_BYTES} bytes")
        start = max(0, len(buf.data) - 3)
        try:
            more = yield from buf.more()
        except ConnectionResetError:
            if reused and not buf.data:
                raise _Stale from None
            raise
        if not more:
            if reused and not buf.data:
                raise _Stale
            raise FetchFailed("connect", "connection closed before the headers ended")
    head = bytes(buf.data[:end]).decode("latin-1")
    del buf.data[:end + 4]
    return buf, head


def _exchange(job: _Job, url: str, max_body: int, accept: str,
              tls: ssl.SSLContext | None, pool: ConnectionPool | None = None) -> Generator[Wait, None, bytes]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchFailed("connect", f"not an http(s) URL: {url!r}")
    https = parts.scheme == "https"
    host = parts.hostname
    port = parts.port or (443 if https else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    connection = "keep-alive" if pool is not None else "close"
    request = (f"GET {target} HTTP/1.1\r\nHost: {parts.netloc.rpartition('@')[2]}\r\nAccept: {accept}\r\n"
               f"Accept-Encoding: gzip\r\nUser-Agent: {USER_AGENT}\r\nConnection: {connection}\r\n\r\n"
               ).encode("ascii", "replace")
    if pool is not None:
        job.key = (parts.scheme, host, port)
    kept = pool.take(job.key) if pool is not None and job.key is not None else None
    while True:
        if kept is not None:
            sock = job.sock = kept
        else:
            sock = yield from _connect(job, host, port, https, tls)
        try:
            buf, head = yield from _request_and_head(job, sock, request, reused=kept is not None)
            break
        except _Stale:
            sock.close()
            job.sock = kept = None  # once: the next attempt is a new connection
    status_line, *header_lines = head.split("\r\n")
    words = status_line.split(" ", 2)
    if len(words) < 2 or not words[0].startswith("HTTP/1.") or not (words[1].isdigit() and len(words[1]) == 3):
        raise FetchFailed("garbage", f"not an HTTP/1.x response: {status_line[:80]!r}")
    status = int(words[1])
    headers: dict[str, str] = {}
    for line in header_lines:
        name, colon, value = line.partition(":")
        if colon:
            headers[name.strip().lower()] = value.strip()
    if 300 <= status < 400:
        raise FetchFailed("redirect", f"HTTP {status} to {headers.get('location', '?')[:200]!r}: redirects are not followed")
    if status != 200:
        raise FetchFailed("http_status", f"HTTP {status}")

    job.phase = "reading the body"
    encoding = headers.get("content-encoding", "identity").lower()
    if encoding not in ("identity", "gzip"):
        raise FetchFailed("garbage", f"unsupported Content-Encoding {encoding[:40]!r}")
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raw = bytearray()
        while True:
            size_line = yield from buf.line(1024)
            size_text = size_line.split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise FetchFailed("garbage", f"bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                break
            if len(raw) + size > max_body:
                raise FetchFailed("too_large", f"body exceeds {max_body} bytes")
            raw += yield from buf.exact(size)
            yield from buf.exact(2)  # the CRLF after the chunk
        body = bytes(raw)
    elif "content-length" in headers:
        text = headers["content-length"]
        if not (text.isascii() and text.isdigit()):
            raise FetchFailed("garbage", f"bad Content-Length {text[:40]!r}")
        length = int(text)
        if length > max_body:
            raise FetchFailed("too_large", f"body of {length} bytes exceeds {max_body} bytes")
        body = yield from buf.exact(length)
    else:
        while (yield from buf.more()):
            if len(buf.data) > max_body:
                raise FetchFailed("too_large", f"body exceeds {max_body} bytes")
        body = bytes(buf.data)
    # Kept for the next round only when the answer ended where its framing says and the server
    # did not ask to close (HTTP/1.0 closes unless it says otherwise: not kept).
    job.keep = (pool is not None and words[0] == "HTTP/1.1" and not buf.data and not buf.eof
                and "close" not in headers.get("connection", "").lower()
                and ("content-length" in headers or "chunked" in headers.get("transfer-encoding", "").lower()))
    if encoding == "gzip":
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            body = inflater.decompress(body, max_body + 1)
        except zlib.error as exc:
            raise FetchFailed("garbage", f"bad gzip body: {exc}") from None
        if len(body) > max_body or inflater.unconsumed_tail:
            raise FetchFailed("too_large", f"decompressed body exceeds {max_body} bytes")
    return body
