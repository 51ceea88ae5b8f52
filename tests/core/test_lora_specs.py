"""LoRA adapter entries of ``BATCHD_MODELS`` (``lora:<base>?path=…``): what parses, what the
settings refuse at start (naming the entry), what a directory must hold, which lines share a
batch with whose."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from core.llms import specs

BASE = "demo:llama-tiny"
UPSTREAM = "upstream:http://127.0.0.1:9/v1?model=big&allow_fields=priority"


def adapter_dir(root: Path, name: str = "adapter") -> Path:
    """A directory that looks like a peft LoRA adapter (what the specs read of it)."""
    path = root / name
    path.mkdir()
    (path / specs.ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (path / specs.ADAPTER_WEIGHTS).write_bytes(b"")
    return path


def test_an_adapter_of_a_local_model(tmp_path: Path) -> None:
    path = adapter_dir(tmp_path)
    models = {"chat": BASE, "support-bot": f"lora:chat?path={path}"}
    found = specs.adapters(models)
    assert found == {"support-bot": specs.LoraSpec("support-bot", "chat", path)}
    assert found["support-bot"].root == "support-bot"  # never the server's directory
    assert specs.engine_models(models) == {"support-bot": "chat"}
    assert specs.kind_of(models["support-bot"]) == "generate"
    assert specs.serves(models["support-bot"], "/v1/chat/completions")
    assert not specs.serves(models["support-bot"], "/v1/embeddings")
    assert specs.forwarded_models(models) == {}  # runs here: its body is checked
    assert specs.check_adapter_dir(path)["r"] == 4


def test_an_adapter_an_upstream_serves() -> None:
    models = {
        "fleet": UPSTREAM,
        "sql": "lora:fleet",
        "support": "lora:fleet?upstream_name=support-lora-v2",
    }
    found = specs.adapters(models)
    assert (found["sql"].forwarded_name, found["sql"].root) == ("sql", "sql")
    assert found["support"].forwarded_name == "support-lora-v2"
    assert found["support"].path is None
    # Their lines go to the upstream as written, with the fields the base's spec allows.
    assert specs.forwarded_models(models) == dict.fromkeys(models, frozenset({"priority"}))


def bad_entries(root: Path) -> list[tuple[dict[str, str], str]]:
    good = adapter_dir(root)
    embedding = root / "embedder"
    embedding.mkdir()
    (embedding / "modules.json").write_text(json.dumps([{"type": "x.models.Pooling"}]))
    return [
        ({"bot": f"lora:chat?path={good}"}, "its base model 'chat' is not an entry"),
        ({"bot": "lora:?path=/x"}, "name the base model"),
        ({"chat": BASE, "bot": "lora:chat"}, "name the adapter's directory"),
        ({"chat": BASE, "bot": f"lora:chat?pth={good}"}, "unknown option 'pth'"),
        ({"chat": BASE, "bot": "lora:chat?path="}, "option path needs a value"),
        ({"chat": BASE, "bot": "lora:chat?path=/a&path=/b"}, "option 'path' is given twice"),
        (
            {"chat": BASE, "one": f"lora:chat?path={good}", "bot": f"lora:one?path={good}"},
            "its base 'one' is itself an adapter",
        ),
        ({"emb": str(embedding), "bot": f"lora:emb?path={good}"}, "is an embedding model"),
        ({"s": "sim:tokens_per_s=10", "bot": f"lora:s?path={good}"}, "a simulated model"),
        ({"fleet": UPSTREAM, "bot": f"lora:fleet?path={good}"}, "leave out path"),
        (
            {"chat": BASE, "bot": f"lora:chat?path={good}&upstream_name=x"},
            "upstream_name is for an adapter of an upstream model",
        ),
    ]


def test_every_problem_names_the_entry(tmp_path: Path) -> None:
    for models, problem in bad_entries(tmp_path):
        entry = next(name for name in models if name == "bot")
        with pytest.raises(ValueError) as caught:
            specs.adapters(models)
        message = str(caught.value)
        assert message.startswith(f"BATCHD_MODELS entry {entry!r} ({models[entry]}): "), message
        assert problem in message, message


def test_every_process_refuses_a_bad_entry_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API, ``python -m worker`` and ``batchd up`` refuse an adapter entry with no base,
    naming it; the settings themselves read ``BATCHD_MODELS`` as text (core's rooms import
    one way: the specs read the settings)."""
    from api.app import create_app
    from cli.models import resolve_models
    from core.llms.gguf import ModelSourceError
    from core.settings import Settings, get_settings
    from worker.__main__ import command

    good = adapter_dir(tmp_path)
    bad = {"chat": BASE, "bot": f"lora:chats?path={good}"}
    monkeypatch.setenv("BATCHD_MODELS", json.dumps(bad))
    named = re.escape("BATCHD_MODELS entry 'bot'")
    with pytest.raises(ValueError, match=named):
        create_app(Settings())
    get_settings.cache_clear()
    try:
        with pytest.raises(SystemExit, match=named):
            command("model", [])
    finally:
        get_settings.cache_clear()
    with pytest.raises(ModelSourceError, match=named):
        resolve_models(bad)
    fixed = {"chat": BASE, "bot": f"lora:chat?path={good}"}
    monkeypatch.setenv("BATCHD_MODELS", json.dumps(fixed))
    create_app(Settings())


def test_a_directory_that_is_no_lora_adapter(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        specs.check_adapter_dir(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        specs.check_adapter_dir(tmp_path / "file")
    with pytest.raises(ValueError, match="not a peft adapter directory: it has no adapter_config"):
        specs.check_adapter_dir(tmp_path)
    (tmp_path / specs.ADAPTER_CONFIG).write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read as JSON"):
        specs.check_adapter_dir(tmp_path)
    (tmp_path / specs.ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "IA3"}))
    with pytest.raises(ValueError, match="is a IA3 adapter, not a LoRA adapter"):
        specs.check_adapter_dir(tmp_path)
    (tmp_path / specs.ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA"}))
    with pytest.raises(ValueError, match="adapter_model.safetensors are missing or unreadable"):
        specs.check_adapter_dir(tmp_path)
    (tmp_path / specs.ADAPTER_WEIGHTS).write_bytes(b"")
    assert specs.check_adapter_dir(tmp_path) == {"peft_type": "LORA"}


def _line(custom_id: str, model: str) -> bytes:
    return json.dumps({
        "custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]},
    }).encode() + b"\n"  # fmt: skip


def test_a_base_and_its_adapters_share_a_batch(tmp_path: Path) -> None:
    from core.batchfile.reader import ValidationReport, validate_file

    path = adapter_dir(tmp_path)
    models = {
        "chat": BASE,
        "other": "demo:llama-25m",
        "a": f"lora:chat?path={path}",
        "b": f"lora:chat?path={path}",
        "c": f"lora:other?path={path}",
    }

    def check(lines: list[bytes]) -> ValidationReport:
        return validate_file(
            lines,
            endpoint="/v1/chat/completions",
            served_models=list(models),
            max_requests=100,
            engine_models=specs.engine_models(models),
        )

    lines = [_line("1", "a"), _line("2", "chat"), _line("3", "b"), _line("4", "a")]
    report = check(lines)
    assert report.ok and report.num_requests == 4
    assert report.model == "chat"  # the batch runs on the base's engine
    report = check([*lines, _line("5", "c"), _line("6", "other")])
    assert [(e.line, e.code) for e in report.errors] == [
        (5, "mismatched_model"),
        (6, "mismatched_model"),
    ]
    assert 'line 5 uses "c", line 1 uses "a"' in report.errors[0].message
    assert "its base model's and its other adapters'" in report.errors[0].message


def test_batchd_up_refuses_an_adapter_directory_naming_the_entry(tmp_path: Path) -> None:
    from cli.models import resolve_models
    from core.llms.gguf import ModelSourceError

    good = adapter_dir(tmp_path)
    models = {"chat": BASE, "bot": f"lora:chat?path={good}"}
    assert resolve_models(models)["bot"] == models["bot"]
    (good / specs.ADAPTER_CONFIG).unlink()
    with pytest.raises(ModelSourceError) as caught:
        resolve_models(models)
    assert str(caught.value) == (
        f"BATCHD_MODELS entry 'bot' ({models['bot']}): {good} is not a peft adapter directory: "
        "it has no adapter_config.json"
    )


def test_a_worker_consumes_the_bases_queue_for_its_adapters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from core.settings import get_settings
    from worker.__main__ import command

    path = adapter_dir(tmp_path)
    monkeypatch.setenv("BATCHD_MODELS", json.dumps({
        "chat": BASE, "bot": f"lora:chat?path={path}", "fleet": UPSTREAM, "sql": "lora:fleet",
    }))  # fmt: skip
    monkeypatch.setenv("BATCHD_HOME", str(tmp_path))
    get_settings.cache_clear()
    try:

        def queues(role: str, names: list[str]) -> str:
            cmd = command(role, names)
            return cmd[cmd.index("-Q") + 1]

        assert queues("model", []) == "batchd.model.chat,batchd.model.fleet"
        assert queues("model", ["bot", "chat"]) == "batchd.model.chat"
        assert queues("dispatch", ["sql"]) == "batchd.model.fleet"
    finally:
        get_settings.cache_clear()
