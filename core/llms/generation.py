"""How a validated batch request becomes engine input, and engine output becomes a result.

Shared by the model worker (``worker/``) and the offline runner (``batchd run``), so both
produce the same tokens, sampling parameters, response bodies and error lines. ``core`` does
not import the engine: the tokenizer (a Hugging Face tokenizer) and the engine's outputs are
used through their attributes, and sampling parameters are built by the constructor the caller
passes (``engine.SamplingParams``) from keyword arguments.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from core.batchfile.bodies.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from core.batchfile.request import COMPLETIONS_DEFAULT_MAX_TOKENS, BatchRequest
from core.batchfile.results import (
    ChoiceResult,
    GenerationResult,
    TokenLogprobInfo,
    output_line,
    request_error_line,
    response_body,
)

logger = logging.getLogger(__name__)


class PromptError(ValueError):
    """A request this model can never run (say, a prompt longer than its context)."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def token_ids(encoded: Any) -> list[int]:
    """Token ids from whatever a tokenizer call returned (list, BatchEncoding or dict)."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    ids = list(encoded)
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]


def encode(tok: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    """The token ids of ``text``. A fast tokenizer's Rust backend is called directly: the
    same ids as calling the tokenizer, in under half the time (the Python wrapper builds a
    batch encoding around every call), which every request line pays at validation."""
    backend = getattr(tok, "backend_tokenizer", None)
    # A backend configured to pad or truncate (sentence-transformers models ship one) would
    # do so here; the tokenizer's own call turns both off for an unpadded encoding.
    if backend is not None and backend.padding is None and backend.truncation is None:
        return backend.encode(text, add_special_tokens=add_special_tokens).ids
    return token_ids(tok(text, add_special_tokens=add_special_tokens))


def prompt_token_ids(tok: Any, req: BatchRequest) -> list[int]:
    """Chat and responses: the model's chat template with the assistant turn opened (rendered,
    then encoded without special tokens, as ``apply_chat_template(tokenize=True)`` does;
    ``chat_template_kwargs`` are the template's variables);
    completions: the prompt string tokenized, or the token list as given; embeddings: every
    input's ids one after another (their count is what quotas and shard sizes weigh; the
    embedding engine frames each input itself)."""
    if req.kind == "embedding":
        return [
            t
            for item in req.inputs or ()
            for t in (encode(tok, item, add_special_tokens=True) if isinstance(item, str) else item)
        ]
    if req.kind in ("chat", "response"):
        return encode(tok, chat_prompt(tok, req), add_special_tokens=False)
    if isinstance(req.prompt, list):
        return [int(t) for t in req.prompt]
    if req.prompt is None:
        raise ValueError(f"a {req.kind} request without a prompt")
    return encode(tok, req.prompt, add_special_tokens=True)


def supports_tools(tok: Any) -> bool:
    """Whether the tokenizer's chat template renders tools (it reads a ``tools`` variable;
    a set of named templates may hold a ``tool_use`` one, which transformers picks then)."""
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):
        return "tool_use" in template or any(_TOOLS.search(t or "") for t in template.values())
    return isinstance(template, str) and _TOOLS.search(template) is not None


_TOOLS = re.compile(r"\btools\b")


def chat_prompt(tok: Any, req: BatchRequest) -> str:
    """The model's chat template rendered with the request's messages (and tools, if any),
    the assistant turn opened; a forced tool call (``tool_choice`` required or named) also
    opens the call, whose JSON the grammar then holds to the functions' schemas
    (core.batchfile.bodies.tools). A model whose template renders no tools refuses a request
    with tools, or with tool calls in its history (:class:`PromptError`)."""
    messages = req.messages or []
    history = next((i for i, m in enumerate(messages) if m.get("tool_calls")), None)
    if (req.tools or history is not None) and not supports_tools(tok):
        param = "body.tools" if req.tools else f"body.messages[{history}].tool_calls"
        raise PromptError(
            "unsupported_parameter",
            f"{param} cannot be served: the chat template of the model {req.model!r} does not "
            "support tools",
            param,
        )
    kwargs = dict(req.chat_template_kwargs or {})
    if req.tools:
        kwargs["tools"] = req.tools
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    if forced_tool_call(req):
        text += TOOL_CALL_OPEN
    return str(text)


def forced_tool_call(req: BatchRequest) -> bool:
    """The request's output is one tool call held to its schema (tool_choice required or a
    named function)."""
    return bool(req.tools) and req.tool_choice not in ("auto", "none")


def default_max_tokens(req: BatchRequest, prompt_len: int, context: int) -> int:
    """OpenAI's defaults: chat may use the rest of the context, completions 16 tokens."""
    if req.max_tokens is not None:
        return req.max_tokens
    remaining = context - prompt_len
    if req.kind == "completion":
        return min(COMPLETIONS_DEFAULT_MAX_TOKENS, max(remaining, 1))
    return max(remaining, 1)


BYTES_PER_TOKEN = 4  # what a prompt's size says of its tokens when no tokenizer is at hand


def approx_prompt_tokens(req: BatchRequest) -> int:
    """A prompt's tokens estimated from its size (an upstream model without a local
    tokenizer): its text's UTF-8 bytes over ``BYTES_PER_TOKEN``, at least one per message."""
    if req.kind == "embedding":
        parts = [
            item if isinstance(item, str) else " " * len(item) * 4 for item in req.inputs or ()
        ]
    elif req.kind == "completion":
        prompt = req.prompt
        parts = [prompt if isinstance(prompt, str) else " " * len(prompt or ()) * 4]
    else:
        parts = [str(m.get("content") or "") for m in req.messages or ()]
    size = sum(len(p.encode("utf-8", "surrogatepass")) for p in parts)
    return max(len(parts), -(-size // BYTES_PER_TOKEN))


def estimate_tokens(req: BatchRequest, prompt_len: int, context: int) -> int:
    """Prompt plus the most output tokens the request may produce: the shard planner's unit."""
    if req.kind == "embedding":
        return prompt_len
    output = min(default_max_tokens(req, prompt_len, context), max(context - prompt_len, 0))
    return prompt_len + output * max(req.n, 1)


def check_prompt(
    req: BatchRequest, prompt_len: int, context: int, vocab_size: int | None = None
) -> None:
    """Raise :class:`PromptError` for a request the model can never run: a token id outside
    the vocabulary, an empty prompt, a prompt that fills the context, or ``max_tokens`` of at
    least the context (``invalid_value``, naming the limit)."""
    param = {"chat": "body.messages", "response": "body.input"}.get(req.kind, "body.prompt")
    if vocab_size is not None and isinstance(req.prompt, list):
        bad = next((t for t in req.prompt if t >= vocab_size), None)
        if bad is not None:
            raise PromptError(
                "invalid_value",
                f"Token id {bad} is out of range: this model's vocabulary has {vocab_size} tokens",
                param,
            )
    if prompt_len == 0:
        raise PromptError("invalid_prompt", "The prompt is empty after tokenization", param)
    if prompt_len >= context:
        raise PromptError(
            "context_length_exceeded",
            f"This model's maximum context length is {context} tokens; the prompt has "
            f"{prompt_len} tokens, which leaves no room for output",
            param,
        )
    if req.max_tokens is not None and req.max_tokens >= context:
        # OpenAI answers 400 "max_tokens is too large" for more output than the model can
        # produce; a limit that merely exceeds what this prompt leaves is clamped (the
        # completion then ends with finish_reason "length").
        name = req.max_tokens_from
        raise PromptError(
            "invalid_value",
            f"{name} is too large: {_short(req.max_tokens)}. This model's maximum context "
            f"length is {context} tokens, so a request can produce at most {context - 1} "
            f"tokens (this prompt of {prompt_len} tokens leaves room for {context - prompt_len})",
            f"body.{name}",
        )


def _short(value: int) -> str:
    text = str(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"


def sampling_kwargs(req: BatchRequest, prompt_len: int, context: int) -> dict[str, Any]:
    """Keyword arguments for ``engine.SamplingParams`` (which rejects values it cannot honour)."""
    max_tokens = default_max_tokens(req, prompt_len, context)
    return {
        "max_tokens": max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
        "stop": list(req.stop) or None,
        "stop_token_ids": list(req.stop_token_ids) or None,
        "ignore_eos": req.ignore_eos,
        # validation keeps it within max_tokens; the context's room may be less
        "min_tokens": min(req.min_tokens, max_tokens),
        "skip_special_tokens": req.skip_special_tokens,
        "n": req.n,
        "logprobs": req.logprobs,
        "top_logprobs": req.top_logprobs,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "json_schema": req.json_schema,
        "regex": req.regex,
        "choice": list(req.choice) if req.choice else None,
    }


def _logprobs(tok: Any, entries: Any) -> list[TokenLogprobInfo] | None:
    if entries is None:
        return None
    return [
        TokenLogprobInfo(
            token=tok.decode([e.token_id]),
            logprob=float(e.logprob),
            top=[(tok.decode([tid]), float(lp), None) for tid, lp in e.top],
        )
        for e in entries
    ]


def generation_result(tok: Any, req: BatchRequest, output: Any) -> GenerationResult:
    """The engine's ``RequestOutput`` as the result that ``core.batchfile.results`` formats.
    A forced tool call's text (the call's JSON: the prompt opened the call) is closed into the
    ``<tool_call>`` block the result parses."""
    forced = forced_tool_call(req)

    def text(c: Any) -> str:
        # the grammar closed the call (a stop string may have cut it first: then it is text)
        if (
            forced
            and (c.finish_reason or "stop") == "stop"
            and getattr(c, "stop_reason", None) is None
        ):
            return TOOL_CALL_OPEN + c.text + TOOL_CALL_CLOSE
        return str(c.text)

    return GenerationResult(
        prompt_tokens=len(output.prompt_token_ids),
        cached_tokens=int(getattr(output.metrics, "num_cached_tokens", 0) or 0),
        choices=[
            ChoiceResult(
                index=c.index,
                text=text(c),
                finish_reason=c.finish_reason or "stop",
                completion_tokens=len(c.token_ids),
                logprobs=_logprobs(tok, c.logprobs) if req.logprobs else None,
                stop_reason=getattr(c, "stop_reason", None),
            )
            for c in output.outputs
        ],
    )


def prepare_request(
    tok: Any,
    req: BatchRequest,
    context: int,
    vocab_size: int | None,
    ids: list[int] | None = None,
    *,
    make_params: Callable[..., Any] = dict,
) -> tuple[list[int], Any]:
    """A request as engine input, the one road from a parsed line to the engine: its prompt
    token ids (``ids`` when the caller has them from the same tokenizer) and its sampling
    parameters, ``make_params(**sampling_kwargs(...))``: the worker and ``batchd run`` pass
    ``engine.SamplingParams`` (which ``core`` does not import); the default is the plain
    keyword arguments. Raises :class:`PromptError` or ``ValueError`` (a value the parameters
    refuse) for a request this model can never run; :func:`error_for_exception` makes its
    line."""
    if ids is None:
        ids = prompt_token_ids(tok, req)
    check_prompt(req, len(ids), context, vocab_size)
    return ids, make_params(**sampling_kwargs(req, len(ids), context))


def is_aborted(output: Any) -> bool:
    """The engine stopped the request before it finished (a cancel, expiry or shutdown)."""
    return not output.finished or any(c.finish_reason == "abort" for c in output.outputs)


def aborted_record(req: BatchRequest) -> dict[str, Any]:
    """The error line of a request the engine aborted and nobody ran again."""
    return error_record(
        req.custom_id,
        "server_error",
        "The request was aborted by the engine",
        status_code=500,
        type="server_error",
    )


def finished_record(
    tok: Any, req: BatchRequest, output: Any, *, model: str | None = None
) -> tuple[dict[str, Any], GenerationResult | None]:
    """The line of a finished, not aborted engine output, and its result (for usage): the
    error line of a request the engine refused (``output.error``; result None), else the
    output line with its response body."""
    if output.error:
        return error_record(req.custom_id, "invalid_request", output.error), None
    result = generation_result(tok, req, output)
    return output_line(req.custom_id, response_body(req, result, model=model)), result


def error_record(
    custom_id: str | None,
    code: str | None,
    message: str,
    *,
    param: str | None = None,
    status_code: int = 400,
    type: str = "invalid_request_error",
) -> dict[str, Any]:
    return request_error_line(
        custom_id, status_code=status_code, message=message, code=code, param=param, type=type
    )


def error_for_exception(req: BatchRequest, exc: BaseException) -> dict[str, Any]:
    """The error line of a request that failed on its own: refused before it ran (a
    :class:`PromptError`, an invalid sampling value, the engine's ``RequestError`` with its
    ``code``) is a 400; anything else the engine raised is a 500 ``server_error``."""
    if isinstance(exc, PromptError):
        return error_record(req.custom_id, exc.code, exc.message, param=exc.param)
    if isinstance(exc, ValueError):
        return error_record(req.custom_id, getattr(exc, "code", None) or "invalid_value", str(exc))
    # The exception's text stays in the worker's log (it may name paths and internals); the
    # tenant's line says what kind of failure it was.
    logger.warning("request %s failed: %r", req.custom_id, exc)
    return error_record(
        req.custom_id,
        "server_error",
        f"The engine failed on this request ({type(exc).__name__}); the service's logs have "
        "the details",
        status_code=500,
        type="server_error",
    )
