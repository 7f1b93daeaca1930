"""Every non-200 answer of the CPU server, with the status, body and content type SGLang 0.5.12 sends.

Owns: ``ProtocolError`` (an HTTP error ready to send) and one constructor per SGLang error shape: the usual
``{"error": {"message": ...}}`` 400 of a ValueError, the FastAPI/pydantic validation 400, the unknown or
ill-typed ``sampling_params`` key (0.5.23's serde-style 400, or 0.5.12's bare text/plain 500), the queue-full
503, and a model backend's failure passed on with its own status.
Must never: decide *whether* a request is wrong (the parsers do), do I/O, or change a body's keys or texts:
clients match on them.
"""

from __future__ import annotations

from typing import Any, Sequence

import orjson


class ProtocolError(Exception):
    """An HTTP answer other than 200: status, raw body bytes and content type, ready to send."""

    def __init__(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        super().__init__(body.decode("utf-8", "replace"))
        self.status = status
        self.body = body
        self.content_type = content_type


def type_name(v: Any) -> str:
    """A JSON value's type as validation messages name it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def bad_request(message: str, status: int = 400) -> ProtocolError:
    """SGLang's usual answer to a ValueError raised while handling /generate: ``{"error": {"message": ...}}``.

    ``status`` 500/503 is how a backend-side failure is passed on (SGLang raises HTTPException with it).
    """
    return ProtocolError(status, orjson.dumps({"error": {"message": message}}))


def validation_error(message: str) -> ProtocolError:
    """The 400 SGLang's FastAPI layer gives when the body fails pydantic type validation."""
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return ProtocolError(400, orjson.dumps(body))


def _bare_500() -> ProtocolError:
    return ProtocolError(500, b"Internal Server Error", "text/plain")


def unknown_field_error(key: str, expected: Sequence[str], status: int = 400) -> ProtocolError:
    """An unknown key inside sampling_params; ``expected`` lists the known keys in declaration order.

    0.5.23 answers 400 ``{"error": "unknown field `k`, expected one of ..."}`` (a plain string, not an object);
    0.5.12 raises an uncaught TypeError, i.e. a bare 500 ``Internal Server Error`` in text/plain.
    """
    if status == 500:
        return _bare_500()
    shown = ", ".join(f"`{k}`" for k in expected)
    return ProtocolError(400, orjson.dumps({"error": f"unknown field `{key}`, expected one of {shown}"}))


def invalid_type_error(key: str, value: Any, expected: str, status: int = 400) -> ProtocolError:
    """An ill-typed value inside sampling_params (same status rules as an unknown field)."""
    if status == 500:
        return _bare_500()
    shown = orjson.dumps(value).decode()[:80]
    return ProtocolError(400, orjson.dumps({"error": f"invalid type: {shown} for field `{key}`, expected {expected}"}))


def service_unavailable(message: str = "The request queue is full.") -> ProtocolError:
    """SGLang's 503 (queue full, waiting/running timeout)."""
    body = {"object": "error", "message": message, "type": "503", "param": None, "code": 503}
    return ProtocolError(503, orjson.dumps(body))
