"""A small HTTP client for batchd's OpenAI-shaped API (``/v1/files``, ``/v1/batches``).

Plain httpx rather than the ``openai`` package: the command line needs the server's error
envelope verbatim, a distinct failure for "cannot connect", streaming uploads and downloads,
and no silent retries that would hide a server that is down.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from core.settings import DEFAULT_BASE_URL, client_settings

_DOWNLOAD_CHUNK = 1 << 16
#: Files larger than this go through the Uploads API, a part of this size at a time (the
#: largest part the API takes).
UPLOAD_PART_BYTES = 64 * 1024 * 1024


class ClientError(Exception):
    """A call that did not succeed; ``message`` is meant for people."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ServerUnreachable(ClientError):
    """No HTTP answer at all: connection refused, DNS, TLS, or a network timeout."""


class APIError(ClientError):
    """The server answered with an error status; the message comes from its error envelope."""

    def __init__(
        self, status_code: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.param = param


def resolve_base_url(base_url: str | None) -> str:
    """``--base-url``, else ``BATCHD_BASE_URL``, else ``OPENAI_BASE_URL``, else the default
    (:class:`core.settings.ClientSettings`)."""
    return (base_url or client_settings().base_url or DEFAULT_BASE_URL).rstrip("/")


def resolve_api_key(api_key: str | None) -> str | None:
    """``--api-key``, else ``BATCHD_API_KEY``, else ``OPENAI_API_KEY``, else none."""
    return api_key or client_settings().api_key or None


def _error_from_response(response: httpx.Response) -> APIError:
    """Build an :class:`APIError` from OpenAI's ``{"error": {message, type, param, code}}``,
    falling back to the status line when the body is not that envelope."""
    message = code = param = None
    try:
        payload = response.json()
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict):
            message, code, param = error.get("message"), error.get("code"), error.get("param")
        elif isinstance(error, str):
            message = error
        elif isinstance(payload.get("detail"), str):
            message = payload["detail"]
    if not message:
        text = response.text.strip()[:200] if response.content else ""
        message = f"{response.status_code} {response.reason_phrase}" + (f": {text}" if text else "")
    return APIError(response.status_code, str(message), code=code, param=param)


class BatchdClient:
    """One connection pool to the API; every method raises :class:`ClientError` subclasses."""

    def __init__(
        self, base_url: str | None = None, api_key: str | None = None, *, timeout: float = 60.0
    ) -> None:
        self.base_url = resolve_base_url(base_url)
        key = resolve_api_key(api_key)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(
            base_url=self.base_url + "/",
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=10.0),
            follow_redirects=True,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> BatchdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ transport

    @contextmanager
    def _translate_errors(self) -> Iterator[None]:
        try:
            yield
        except httpx.TimeoutException as exc:
            raise ServerUnreachable(
                f"The server at {self.base_url} did not answer in time ({type(exc).__name__})"
            ) from None
        except httpx.TransportError as exc:
            reason = str(exc) or type(exc).__name__
            raise ServerUnreachable(
                f"Cannot reach the server at {self.base_url}: {reason}"
            ) from None

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        with self._translate_errors():
            response = self._http.request(method, path.lstrip("/"), **kwargs)
        if response.status_code >= 400:
            raise _error_from_response(response)
        try:
            return response.json()
        except ValueError:
            raise APIError(
                response.status_code, f"The server's answer to {method} {path} is not JSON"
            ) from None

    # ------------------------------------------------------------------ files

    def upload_file(
        self, path: Path, *, purpose: str = "batch", part_bytes: int = UPLOAD_PART_BYTES
    ) -> dict[str, Any]:
        """Upload ``path``: in one request (streamed from disk by httpx's multipart encoder),
        or, when it is larger than one part, through the Uploads API, a part at a time."""
        size = path.stat().st_size
        if size > part_bytes:
            return self._upload_in_parts(path, size, purpose, part_bytes)
        with open(path, "rb") as fh:
            return self._request(
                "POST",
                "files",
                data={"purpose": purpose},
                files={"file": (path.name, fh, "application/jsonl")},
            )

    def _upload_in_parts(
        self, path: Path, size: int, purpose: str, part_bytes: int
    ) -> dict[str, Any]:
        """The Uploads API: create, add the parts in order, complete with the file's MD5 (the
        client holds one part in memory at a time)."""
        upload = self._request(
            "POST",
            "uploads",
            json={
                "filename": path.name,
                "purpose": purpose,
                "bytes": size,
                "mime_type": "application/jsonl",
            },
        )
        digest = hashlib.md5(usedforsecurity=False)
        part_ids: list[str] = []
        with open(path, "rb") as fh:
            while chunk := fh.read(part_bytes):
                digest.update(chunk)
                part = self._request(
                    "POST", f"uploads/{upload['id']}/parts", files={"data": ("part", chunk)}
                )
                part_ids.append(part["id"])
        done = self._request(
            "POST",
            f"uploads/{upload['id']}/complete",
            json={"part_ids": part_ids, "md5": digest.hexdigest()},
        )
        return done["file"]

    def download_file(self, file_id: str, destination: Path) -> int:
        """Stream a file's content to ``destination`` (written whole or not at all); returns
        the number of bytes."""
        destination = Path(destination)
        tmp = destination.with_name(destination.name + ".download")
        written = 0
        with self._translate_errors(), self._http.stream("GET", f"files/{file_id}/content") as r:
            if r.status_code >= 400:
                r.read()
                raise _error_from_response(r)
            with open(tmp, "wb") as out:
                for chunk in r.iter_bytes(_DOWNLOAD_CHUNK):
                    out.write(chunk)
                    written += len(chunk)
        os.replace(tmp, destination)
        return written

    # ------------------------------------------------------------------ batches

    def create_batch(
        self,
        input_file_id: str,
        *,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None = None,
        idempotency_key: str | None = None,
        priority: str | None = None,
        max_total_tokens: int | None = None,
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "input_file_id": input_file_id,
            "endpoint": endpoint,
            "completion_window": completion_window,
        }
        if metadata:
            payload["metadata"] = metadata
        if priority:
            payload["priority"] = priority  # batchd's extension: high | normal | low
        if max_total_tokens is not None:
            payload["max_total_tokens"] = max_total_tokens  # batchd's extension: a budget
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self._request("POST", "batches", json=payload, headers=headers)

    def estimate_batch(
        self,
        input_file_id: str,
        *,
        endpoint: str,
        completion_window: str,
        priority: str | None = None,
    ) -> dict[str, Any]:
        """What a create would make of the file, and when it would end; creates nothing
        (batchd's extension)."""
        payload: dict[str, Any] = {
            "input_file_id": input_file_id,
            "endpoint": endpoint,
            "completion_window": completion_window,
        }
        if priority:
            payload["priority"] = priority
        return self._request("POST", "batches/estimate", json=payload)

    def delete_file(self, file_id: str) -> dict[str, Any]:
        return self._request("DELETE", f"files/{file_id}")

    def get_batch(self, batch_id: str) -> dict[str, Any]:
        return self._request("GET", f"batches/{batch_id}")

    def list_batches(self, *, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if after:
            params["after"] = after
        return self._request("GET", "batches", params=params)

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        return self._request("POST", f"batches/{batch_id}/cancel")

    def pause_batch(self, batch_id: str) -> dict[str, Any]:
        return self._request("POST", f"batches/{batch_id}/pause")

    def resume_batch(self, batch_id: str) -> dict[str, Any]:
        return self._request("POST", f"batches/{batch_id}/resume")

    def batch_results(
        self, batch_id: str, *, after: str | None = None, limit: int = 1000
    ) -> dict[str, Any]:
        """One page of the result lines committed so far (batchd's extension)."""
        params: dict[str, Any] = {"limit": limit}
        if after:
            params["after"] = after
        return self._request("GET", f"batches/{batch_id}/results", params=params)

    def retry_batch(self, batch_id: str, **options: Any) -> dict[str, Any]:
        """A new batch of what did not succeed (batchd's extension); ``options``: include,
        completion_window, priority, max_total_tokens (None: the server's default)."""
        payload = {k: v for k, v in options.items() if v is not None}
        return self._request("POST", f"batches/{batch_id}/retry", json=payload)

    def file_content(self, file_id: str) -> bytes:
        with self._translate_errors():
            response = self._http.get(f"files/{file_id}/content")
        if response.status_code >= 400:
            raise _error_from_response(response)
        return response.content

    # ------------------------------------------------------------------ models

    def list_models(self) -> list[dict[str, Any]]:
        """The served models: ``{"id", "kind", "endpoints", …}`` each."""
        return list(self._request("GET", "models").get("data") or [])
