"""Slow clients: read deadlines and a bound on open connections, for the uvicorn server LitServe runs.

uvicorn (0.55) closes an idle keep-alive connection after ``timeout_keep_alive``, but it has no
deadline for reading a request: a client that sends its headers (or its body) one byte at a time
keeps a connection, and a file descriptor, for as long as it likes, and ``limit_concurrency`` only
answers 503 once a request's headers are complete, which a slow client never reaches. A few hundred
such clients exhaust a server's ~1,024 descriptors (slowloris).

``guarded_protocol`` makes a subclass of uvicorn's own HTTP protocol (httptools, else h11), passed
to uvicorn as ``http=``, that adds, per connection:

* a header deadline: the request line and headers must be complete within ``header_timeout_s`` of
  the connection opening, or of the previous response on a kept-alive connection; bytes dripping
  in do not extend it;
* a body deadline: the body must be complete within ``body_timeout_s`` of the headers;
* a bound: while ``max_connections`` connections are open, a new one is answered 503 and closed at
  once (its descriptor freed at once, unlike ``limit_concurrency``).

A request past its deadline is answered 408 (JSON ``{"detail": ...}``, as the request edge answers)
when no response has started, then closed; a connection that sent nothing is closed silently.

Closing after such an answer is a lingering close (as nginx's ``lingering_close``): the server sends
the answer and its FIN, then reads and discards what the client still sends for up to ``LINGER_S``
before it closes. Closing at once, with the client's bytes unread in the server's buffer, makes the
kernel send a reset, and a client still sending (the slow client is) loses the answer with it.
"""

from __future__ import annotations

import asyncio

from vitpipe.tasks.serving.edge import error_body

LINGER_S = 1.0  # how long an answered-and-refused client may still send before the close


def _base_protocol() -> type:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol  # uvicorn's "auto" choice when httptools is installed
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def raw_response(status: int, reason: str, message: str) -> bytes:
    """A complete HTTP/1.1 response with a one-line JSON body that closes the connection."""
    body = error_body(message)
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("latin-1") + body


class _Deadlines:
    """The mixin; its settings are class attributes set by ``guarded_protocol``."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 256

    def connection_made(self, transport) -> None:
        self._timer: asyncio.TimerHandle | None = None
        self._lingering = False
        self._seen_cycle = None  # the request whose headers were complete when last looked at
        self._received = False  # bytes of a request not yet answered have arrived
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._answer_and_close(raw_response(503, "Service Unavailable",
                                                f"the server holds {self.max_connections} open connections "
                                                "(max_connections); retry shortly"))
            return
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # answered and closing: read only so that the close is not a reset
        self._received = True
        super().data_received(data)
        cycle = getattr(self, "cycle", None)
        if cycle is not None and cycle is not self._seen_cycle and not cycle.response_complete:
            self._seen_cycle = cycle  # the headers just completed: the body has its own deadline
            self._arm(self.body_timeout_s, "body")
        if cycle is not None and cycle is self._seen_cycle and not cycle.more_body:
            self._cancel()  # the whole request is in: the model's time is not a read

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not (self.transport.is_closing() or self._lingering):
            self._await_headers()  # the next request on this kept-alive connection

    def connection_lost(self, exc) -> None:
        self._cancel()
        super().connection_lost(exc)

    # ------------------------------------------------------------------ timers

    def _await_headers(self) -> None:
        cycle = getattr(self, "cycle", None)
        if cycle is not None and not cycle.response_complete:
            return  # a pipelined request is already in: it is answered, then the next one awaited
        self._received = False
        self._arm(self.header_timeout_s, "headers")

    def _arm(self, seconds: float, what: str) -> None:
        self._cancel()
        self._timer = self.loop.call_later(seconds, self._expired, what, seconds)

    def _cancel(self) -> None:
        timer = getattr(self, "_timer", None)
        if timer is not None:
            timer.cancel()
            self._timer = None

    def _expired(self, what: str, seconds: float) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        cycle = getattr(self, "cycle", None)
        in_progress = cycle is not None and not cycle.response_complete
        if (what == "headers" and in_progress) or (what == "body" and not (in_progress and cycle.more_body)):
            return  # the request got past this stage meanwhile (a pipelined one): nothing to enforce
        started = what == "body" and cycle.response_started
        if cycle is not None and what == "body":
            cycle.disconnected = True  # the app's receive() now returns http.disconnect
            cycle.message_event.set()
        if self._received and not started:
            key = "header_timeout_s" if what == "headers" else "body_timeout_s"
            self._answer_and_close(raw_response(408, "Request Timeout",
                                                f"the request {what} did not arrive within {seconds:g} s ({key})"))
        else:
            self.transport.close()

    def _answer_and_close(self, response: bytes) -> None:
        """Send ``response`` and a FIN, discard what arrives for up to ``LINGER_S``, then close."""
        self._lingering = True
        self.transport.write(response)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        if not self.transport.is_reading():
            self.transport.resume_reading()  # paused by flow control: unread bytes would make the close a reset
        self._timer = self.loop.call_later(LINGER_S, self.transport.close)


def guarded_protocol(*, header_timeout_s: float, body_timeout_s: float, max_connections: int,
                     base: type | None = None) -> type:
    """uvicorn's HTTP protocol class (``base``, default: httptools, else h11) with the deadlines and the
    bound above; pass it as ``uvicorn.Config(http=...)`` (LitServe: ``server.run(http=...)``)."""
    base = base or _base_protocol()
    return type(f"Guarded{base.__name__}", (_Deadlines, base),
                {"header_timeout_s": float(header_timeout_s), "body_timeout_s": float(body_timeout_s),
                 "max_connections": int(max_connections)})
