"""A request's keep outside ``mm_processor_kwargs`` is refused by the OpenAI server (HTTP 400), not silently ignored.

vLLM's OpenAI server drops a request body's unknown top-level fields with a debug log, so a client that sends
``{"vtprune_keep": 0.5, ...}`` (the OpenAI client's ``extra_body={"vtprune_keep": 0.5}``) would be served at the
model's keep without a word. :class:`RequestKeyCheck` is an ASGI middleware (vLLM's ``--middleware
vtprune.vllm.middleware.RequestKeyCheck``, which ``vtprune serve`` passes through) that reads each JSON ``POST``
body, answers 400 with one line when a top-level key names ``vtprune`` (the keep belongs in ``mm_processor_kwargs``),
and otherwise hands the body on unchanged. Pure ASGI: no vLLM, Starlette or FastAPI import.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from vtprune.vllm.settings import REQUEST_KEY

#: the option that adds this middleware to vLLM's OpenAI server
OPTION = ("--middleware", "vtprune.vllm.middleware.RequestKeyCheck")


def server_options(given: list[str]) -> list[str]:
    """:data:`OPTION` for a vLLM server command whose other options are ``given``, unless they already add it."""
    named = any(arg == OPTION[1] or arg == f"{OPTION[0]}={OPTION[1]}" for arg in given)
    return [] if named else list(OPTION)


def misplaced_keys(body: bytes) -> str | None:
    """The one-line refusal of a JSON request ``body`` with a top-level key naming ``vtprune``, else None (a body that
    is not a JSON object is left to vLLM)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    wrong = sorted(str(key) for key in data if "vtprune" in str(key).lower())
    if not wrong:
        return None
    return (f"vtprune: {', '.join(map(repr, wrong))} at the top level of the request is not read by vLLM; send the "
            f"per-request keep inside mm_processor_kwargs, e.g. {{\"mm_processor_kwargs\": {{\"{REQUEST_KEY}\": 0.5}}}} "
            "(the server needs --trust-request-mm-kwargs).")


class RequestKeyCheck:
    """ASGI middleware: ``POST`` bodies with a top-level ``vtprune*`` key get HTTP 400 (:func:`misplaced_keys`)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        messages, body = await _read_body(receive)
        problem = misplaced_keys(body)
        if problem is not None:
            await _bad_request(send, problem)
            return
        pending = list(messages)

        async def replay() -> dict:
            return pending.pop(0) if pending else await receive()

        await self.app(scope, replay, send)


async def _read_body(receive: Callable[[], Awaitable[dict]]) -> tuple[list[dict], bytes]:
    """Every message of a request's body (to replay them) and the body's bytes."""
    messages: list[dict] = []
    chunks: list[bytes] = []
    while True:
        message = await receive()
        messages.append(message)
        if message.get("type") != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return messages, b"".join(chunks)


async def _bad_request(send: Callable[[dict], Awaitable[None]], message: str) -> None:
    """An OpenAI-style error response with status 400."""
    payload: dict[str, Any] = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
