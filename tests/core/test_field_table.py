"""docs/api.md's field-support table is what the code's field lists generate, and those lists
are the ones the checks apply: a field a list refuses is refused, on the models it says."""

from __future__ import annotations

import difflib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.batchfile.bodies import KINDS
from core.batchfile.bodies.fields import FIELDS, REFUSED, REFUSED_EVERYWHERE
from core.batchfile.field_table import END, REGENERATE, START, replace_in, table_markdown
from core.batchfile.reader import RawLine, parse_request
from core.batchfile.request import LineError

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "api.md"
BASE = {
    "chat": {"messages": [{"role": "user", "content": "hi"}]},
    "completion": {"prompt": "hi"},
    "embedding": {"input": "hi"},
    "response": {"input": "hi"},
}


def test_the_doc_holds_the_generated_table() -> None:
    current = DOC.read_text(encoding="utf-8")
    assert current.count(START) == 1 and current.count(END) == 1
    expected = replace_in(current)
    if current != expected:
        diff = difflib.unified_diff(
            current.splitlines(),
            expected.splitlines(),
            "docs/api.md",
            "generated",
            lineterm="",
            n=0,
        )
        shown = "\n".join(list(diff)[:30])
        pytest.fail(
            f"docs/api.md's field table is out of date with the code; regenerate it with\n"
            f"    {REGENERATE}\n{shown}",
            pytrace=False,
        )


def test_the_generator_runs_as_documented() -> None:
    printed = subprocess.run(
        [sys.executable, "-m", "core.batchfile.field_table"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    assert printed == table_markdown()
    assert REGENERATE in DOC.read_text(encoding="utf-8")


def parse(url: str, body: dict, forwarded: bool) -> None:
    obj = {"custom_id": "a", "method": "POST", "url": url, "body": {"model": "m", **body}}
    raw = json.dumps(obj).encode()
    parse_request(
        RawLine(1, 0, len(raw), raw),
        endpoint=url,
        served_models=None,
        forwarded=["m"] if forwarded else (),
    )


@pytest.mark.parametrize("url", list(KINDS))
def test_the_lists_are_what_the_checks_refuse(url: str) -> None:
    kind = KINDS[url]
    assert set(REFUSED[kind]) <= set(FIELDS[kind])
    assert set(REFUSED_EVERYWHERE[kind]) <= set(FIELDS[kind])
    parse(url, BASE[kind], forwarded=False)
    for name in (*REFUSED[kind], *REFUSED_EVERYWHERE[kind]):
        body = {**BASE[kind], name: ["x"]}
        with pytest.raises(LineError) as caught:
            parse(url, body, forwarded=False)
        assert (caught.value.code, caught.value.param) == ("unsupported_parameter", f"body.{name}")
        if name in REFUSED[kind]:
            parse(url, body, forwarded=True)  # an upstream model gets it as written
        else:
            with pytest.raises(LineError):
                parse(url, body, forwarded=True)
