"""The request edge of ``POST /predict``: what can be judged before a request reaches a model worker.

``RequestGate`` is a plain ASGI middleware in front of LitServe's route. It answers, itself and at
once, with a 4xx and one line of JSON (``{"detail": "..."}``, FastAPI's error shape):

* 415 a Content-Type other than ``application/json`` or ``multipart/form-data``;
* 413 a body over ``max_body_bytes`` (by its Content-Length, or counted while it arrives);
* 400 an empty body, a JSON body that does not parse or nests deeper than ``vitpipe.run.jsonfiles.MAX_DEPTH``
  levels (read without recursion: never a RecursionError), an ``explain`` the checkpoint cannot draw;
* 422 a JSON body that is not an object.

LitServe forwards the parsed body (only) to a worker, so ``?explain=`` is carried into it here: as
the ``explain`` key of a JSON object, or as an ``explain`` field of a multipart form.
"""

from __future__ import annotations

import json
import re
from urllib.parse import parse_qs

from vitpipe.inference.explain import method_name
from vitpipe.run.jsonfiles import JSONInputError, loads

CONTENT_TYPES = ("application/json", "multipart/form-data")
USAGE = "send application/json {\"image\": \"<base64 of the file>\"} or multipart/form-data with the file in field 'image'"


def error_body(message: str) -> bytes:
    """The one-line JSON of every refusal."""
    return json.dumps({"detail": message}, separators=(",", ":")).encode()


async def reply(send, status: int, message: str) -> None:
    body = error_body(message)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class BodyTooLarge(Exception):
    pass


class Disconnected(Exception):
    """The client went away (or was closed for sending too slowly) before its body was complete."""


class RequestGate:
    """ASGI middleware for POST ``path``; see the module docstring. ``explain_choices``: the ``explain``
    values this checkpoint can draw (empty: none)."""

    def __init__(self, app, *, path: str = "/predict", max_body_bytes: int, explain_choices: tuple[str, ...] = ()):
        self.app, self.path, self.max_body_bytes, self.explain_choices = app, path, max_body_bytes, explain_choices

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"].rstrip("/") != self.path or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        content_type = headers.get("content-type", "")
        kind = content_type.split(";")[0].strip().lower()
        if kind not in CONTENT_TYPES:
            await reply(send, 415, f"Content-Type {content_type or '(none)'!r} is not accepted; {USAGE}")
            return
        explain, why = self.explain_of(scope)
        if why:
            await reply(send, 400, why)
            return
        limit = f"the request body is over the server's limit of {self.max_body_bytes / 1e6:g} MB (max_body_mb)"
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await reply(send, 413, limit)
            return
        try:
            body = await self.read_body(receive)
        except BodyTooLarge:
            await reply(send, 413, limit)
            return
        except Disconnected:
            return  # nobody to answer; a partial body is never parsed
        if not body:
            await reply(send, 400, f"the request body is empty; {USAGE}")
            return
        if kind == "application/json":
            try:
                payload = loads(body)  # bounded: a body nested 1,000 deep is this 400, not a RecursionError's 500
            except JSONInputError as e:
                await reply(send, 400, f"the body is refused: {e}; {USAGE}")
                return
            except (ValueError, UnicodeDecodeError) as e:
                await reply(send, 400, f"the body is not valid JSON ({str(e).splitlines()[0]}); {USAGE}")
                return
            if not isinstance(payload, dict):
                await reply(send, 422, f"the JSON body is a {type(payload).__name__}, not an object; {USAGE}")
                return
            if explain:
                body = json.dumps({**payload, "explain": explain}).encode()
        elif explain:
            body = with_form_field(body, content_type, "explain", explain)
        await self.app(_with_body(scope, body), _replay(body, receive), send)

    def explain_of(self, scope) -> tuple[str | None, str | None]:
        """(the ``explain`` query value or None, why it is refused or None)."""
        values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("explain")
        if not values:
            return None, None
        value = values[-1]
        if method_name(value) in self.explain_choices:  # any spelling; the worker gets the canonical name
            return method_name(value), None
        valid = ", ".join(self.explain_choices) if self.explain_choices else "none for this checkpoint"
        return None, f"explain={value!r} is not available; valid: {valid}"

    async def read_body(self, receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def with_form_field(body: bytes, content_type: str, name: str, value: str) -> bytes:
    """A multipart/form-data ``body`` with one more text field (before the closing boundary); unchanged
    when the boundary is not found (the form parser then reports the malformed body)."""
    found = re.search(r'boundary="?([^";]+)"?', content_type)
    if not found:
        return body
    close = b"--" + found.group(1).encode("latin-1") + b"--"
    at = body.rfind(close)
    if at < 0:
        return body
    part = (b"--" + found.group(1).encode("latin-1") + b"\r\n"
            + f'Content-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    return body[:at] + part + body[at:]


def _with_body(scope, body: bytes):
    """The scope with its Content-Length set to the (possibly rewritten) body's."""
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}


def _replay(body: bytes, receive):
    """A ``receive`` giving the whole body once, then the connection's own messages (a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
