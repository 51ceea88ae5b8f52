"""Writing a finished batch's files: as the server made them, or merged with its retries."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cli.client import BatchdClient
from cli.console import stderr
from cli.exit_codes import TERMINAL_STATUSES
from core.batches.retry import RETRY_OF, merge_with_retries


def download_results(
    client: BatchdClient, batch: dict[str, Any], output: Path | None, errors: Path | None
) -> dict[str, Any]:
    """Download the output (and error) file of a finished batch; a batch with no output (or
    errors) gets an empty file, so a pipeline always finds the paths it asked for."""
    written: dict[str, Any] = {
        "output": str(output) if output else None,
        "errors": str(errors) if errors else None,
    }
    for key, path in (("output", output), ("errors", errors)):
        if path is None:
            continue
        file_id = batch.get(f"{key}_file_id" if key == "output" else "error_file_id")
        if file_id:
            written[f"{key}_bytes"] = client.download_file(file_id, path)
        else:
            Path(path).write_bytes(b"")
            written[f"{key}_bytes"] = 0
    return written


def _lines(client: BatchdClient, file_id: str | None) -> list[dict[str, Any]]:
    if not file_id:
        return []
    return [json.loads(x) for x in client.file_content(file_id).splitlines() if x.strip()]


def _retries_of(client: BatchdClient, parent: dict[str, Any]) -> list[dict[str, Any]]:
    """The retries of ``parent`` and of its retries, oldest first (a retry is created after
    its parent, so the listing, newest first, stops at the parent)."""
    candidates: list[dict[str, Any]] = []
    after = None
    while True:
        page = client.list_batches(limit=100, after=after)
        data = page.get("data") or []
        candidates += [b for b in data if b.get("created_at", 0) >= parent.get("created_at", 0)]
        if (
            not page.get("has_more")
            or not data
            or data[-1].get("created_at", 0) < parent.get("created_at", 0)
        ):
            break
        after = page.get("last_id")
    family = {parent["id"]}
    chain = []
    for batch in sorted(candidates, key=lambda b: (b.get("created_at", 0), b["id"])):
        if (batch.get("metadata") or {}).get(RETRY_OF) in family:
            family.add(batch["id"])
            chain.append(batch)
    return chain


def _input_order(client: BatchdClient, batch: dict[str, Any]) -> Iterator[str]:
    for line in _lines(client, batch.get("input_file_id")):
        if isinstance(line.get("custom_id"), str):
            yield line["custom_id"]


def download_with_retries(client: BatchdClient, batch: dict[str, Any], output: Path) -> dict:
    """Write the parent's results with each line replaced by its latest retry's: one line per
    ``custom_id``, in the parent's input order."""
    chain = _retries_of(client, batch)
    layers = [
        _lines(client, batch.get("output_file_id")) + _lines(client, batch.get("error_file_id"))
    ]
    used = []
    for retry_batch in chain:
        if retry_batch.get("status") not in TERMINAL_STATUSES:
            stderr().print(
                f"retry {retry_batch['id']} is still {retry_batch.get('status')}: not included"
            )
            continue
        used.append(retry_batch["id"])
        layers.append(
            _lines(client, retry_batch.get("output_file_id"))
            + _lines(client, retry_batch.get("error_file_id"))
        )
    merged = merge_with_retries(list(_input_order(client, batch)), layers)
    tmp = output.with_name(output.name + ".download")
    with tmp.open("wb") as out:
        for line in merged:
            out.write(json.dumps(line, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")
    tmp.replace(output)
    return {"output": str(output), "lines": len(merged), "retries": used}
