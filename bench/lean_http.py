"""A small HTTP/1.1 client for the load generator: asyncio streams, keep-alive, chunked bodies.

The load client shares the machine's cores with the server it measures, so every millisecond of
its CPU per streamed token is taken from the server, the most from the fastest one; through
httpx (h11's parser, httpcore's pool and anyio under each SSE line) it spent two to four times
this client's (docs/benchmarks-history.md). This client reads the same bytes with less Python: a
line parser over `StreamReader` and a pool of idle connections per host. It speaks plain HTTP and
HTTPS (TLS from `ssl`), one request per connection at a time, which is all `bench/run.py` needs.

    async with LeanClient(timeout=60) as client:
        async with client.stream("POST", url, json=body) as response:
            async for line in response.aiter_lines(): ...
"""

from __future__ import annotations

import asyncio
import json as jsonlib
import ssl
from contextlib import asynccontextmanager
from urllib.parse import urlsplit


class LeanResponse:
    """The status, the headers (lower-case names) and the body, read as it arrives."""

    def __init__(self, reader: asyncio.StreamReader, status_code: int, headers: dict[str, str], head_only: bool):
        self._reader = reader
        self.status_code = status_code
        self.headers = headers
        self.text = ""
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self._left = int(length) if length is not None and not self._chunked else None
        self.complete = head_only or self._left == 0  # the body was read to its end: the connection can be reused

    async def aiter_bytes(self):
        reader = self._reader
        if self.complete:
            return
        if self._chunked:
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
                        pass
                    self.complete = True
                    return
                data = await reader.readexactly(size + 2)
                yield data[:-2]
        elif self._left is not None:
            while self._left > 0:
                data = await reader.read(min(self._left, 65536))
                if not data:
                    raise ConnectionError("the server closed the connection before the body's end")
                self._left -= len(data)
                yield data
            self.complete = True
        else:  # no length: the body ends when the server closes the connection
            while data := await reader.read(65536):
                yield data

    async def aiter_lines(self):
        """The body's lines without their line ends (an SSE stream's fields)."""
        rest = b""
        async for data in self.aiter_bytes():
            lines = (rest + data).split(b"\n")
            rest = lines.pop()
            for line in lines:
                yield line.rstrip(b"\r").decode("utf-8", "replace")
        if rest:
            yield rest.rstrip(b"\r").decode("utf-8", "replace")

    async def aread(self) -> bytes:
        body = b"".join([data async for data in self.aiter_bytes()])
        self.text = body.decode("utf-8", "replace")
        return body


class LeanClient:
    """Keep-alive connections per (scheme, host, port); `timeout` bounds the connect."""

    def __init__(self, timeout: float = 30.0):
        self.timeout = timeout
        self._idle: dict[tuple, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def __aenter__(self) -> "LeanClient":
        return self

    async def __aexit__(self, *exc) -> None:
        for pool in self._idle.values():
            for _, writer in pool:
                writer.close()
        self._idle.clear()

    async def _connect(self, key: tuple, reuse: bool):
        """(reader, writer, reused): an idle connection if `reuse` and one is left, else a new one."""
        scheme, host, port = key
        pool = self._idle.get(key)
        while reuse and pool:
            reader, writer = pool.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer, True
            writer.close()
        if scheme == "https" and self._ssl is None:
            self._ssl = ssl.create_default_context()
        reader, writer = await asyncio.wait_for(asyncio.open_connection(
            host, port, ssl=self._ssl if scheme == "https" else None, limit=2**20), self.timeout)
        return reader, writer, False

    async def _send(self, key: tuple, request: bytes):
        """Send `request`; (reader, writer, status line). An idle connection the server closed
        meanwhile (its keep-alive timeout) fails before any byte comes back: then once more on a
        new one."""
        reader, writer, reused = await self._connect(key, reuse=True)
        while True:
            try:
                writer.write(request)
                return reader, writer, await reader.readuntil(b"\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()
                if not reused:
                    raise
            except BaseException:
                writer.close()
                raise
            reader, writer, reused = await self._connect(key, reuse=False)

    @asynccontextmanager
    async def stream(self, method: str, url: str, json=None, headers: dict[str, str] | None = None):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"only http:// and https:// URLs, not {url!r}")
        key = (parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        body = b"" if json is None else jsonlib.dumps(json).encode()
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", "Accept: */*",
                f"Content-Length: {len(body)}"]
        if json is not None:
            head.append("Content-Type: application/json")
        head += [f"{name}: {value}" for name, value in (headers or {}).items()]
        reader, writer, status_line = await self._send(key, ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        response = None
        try:
            fields = {}
            while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
                name, _, value = line.decode("latin-1").partition(":")
                fields[name.strip().lower()] = value.strip()
            status = int(status_line.split(None, 2)[1])
            response = LeanResponse(reader, status, fields, head_only=method == "HEAD" or status in (204, 304))
            yield response
        finally:
            reusable = (response is not None and response.complete
                        and response.headers.get("connection", "").lower() != "close")
            if reusable:
                self._idle.setdefault(key, []).append((reader, writer))
            else:
                writer.close()
