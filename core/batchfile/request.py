"""A validated batch request, the error of a line that is not one, and the limits and URLs
both refer to (``reader`` reads the lines, ``bodies`` checks each endpoint's body)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

RequestKind = Literal["chat", "completion", "embedding", "response"]

CHAT_URL: Final = "/v1/chat/completions"
COMPLETIONS_URL: Final = "/v1/completions"
EMBEDDINGS_URL: Final = "/v1/embeddings"
RESPONSES_URL: Final = "/v1/responses"
SUPPORTED_URLS: tuple[str, ...] = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, RESPONSES_URL)
GENERATION_URLS: tuple[str, ...] = (CHAT_URL, COMPLETIONS_URL, RESPONSES_URL)
# OpenAI's limit on the inputs of one embeddings request.
MAX_EMBEDDING_INPUTS = 2048
ENCODING_FORMATS = ("float", "base64")
MAX_CUSTOM_ID_CHARS = 512
DEFAULT_MAX_LINE_BYTES = 8 * 1024 * 1024
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_SEQUENCES = 4
MAX_REPETITION_PENALTY = 10.0


class LineError(Exception):
    """A problem with one input line (or the whole file when ``line`` is None)."""

    def __init__(self, line: int | None, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.line = line
        self.code = code
        self.message = message
        self.param = param

    def to_dict(self) -> dict[str, Any]:
        """The shape of one entry of OpenAI's batch ``errors.data``."""
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}

    def __repr__(self) -> str:
        return f"LineError(line={self.line!r}, code={self.code!r}, param={self.param!r}, message={self.message!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LineError) and self.to_dict() == other.to_dict()

    __hash__ = Exception.__hash__


@dataclass(slots=True)
class BatchRequest:
    """One validated request, with sampling parameters normalised to plain values."""

    line: int
    offset: int
    length: int
    custom_id: str
    url: str
    model: str
    body: dict[str, Any]
    kind: RequestKind
    # chat, responses: role/content(/name), text parts flattened; an assistant turn's
    # tool_calls and a tool turn's tool_call_id as the chat template reads them
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None  # completion: text or token ids
    max_tokens: int | None = None  # None: the caller applies its default
    max_tokens_from: str = "max_tokens"  # the body field it came from: max_tokens_field()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    n: int = 1
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    # vLLM's extensions (chat and completions; see core.batchfile.bodies.fields)
    min_p: float = 0.0  # 0: disabled
    repetition_penalty: float = 1.0  # 1: disabled
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # chat: variables for the template
    # embeddings: the inputs (texts or token-id arrays), their output format and size
    inputs: list[str | list[int]] | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    # structured output: the JSON Schema the output must match (``{"type": "object"}`` for
    # any JSON object); None for free text
    json_schema: dict[str, Any] | None = None
    regex: str | None = None  # vLLM's guided_regex: the output matches this regular expression
    choice: list[str] | None = None  # vLLM's guided_choice: the output is one of these strings
    # chat tools (core.batchfile.bodies.tools): the functions as the chat template reads them,
    # and the tool_choice: "auto", "required", or the name of the one function to call ("none"
    # leaves ``tools`` None: the prompt is rendered without them)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True


def max_tokens_field(kind: RequestKind, body: Mapping[str, Any]) -> str:
    """The body field that limits a request's output: ``max_output_tokens`` for responses,
    ``max_tokens`` for completions, and for chat ``max_completion_tokens``, which wins over
    the older ``max_tokens`` when both are given."""
    if kind == "response":
        return "max_output_tokens"
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return "max_tokens"


# JSON's name for each Python type a parsed line holds (bool before int: it is one).
_JSON_TYPES: tuple[tuple[type, str], ...] = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    for kind, name in _JSON_TYPES:
        if isinstance(value, kind):
            return name
    return type(value).__name__


def show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
