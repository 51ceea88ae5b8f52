"""The body fields each endpoint accepts, written once: OpenAI's fields plus the vLLM extensions
the engine honours. A field outside its endpoint's list refuses the line
(``unknown_parameter``), except on lines forwarded as written to an upstream model. Accepting a
field is not honouring every value of it: the endpoint's checks refuse what this service cannot
do. ``docs/batch-files.md`` lists these same names (a test compares them)."""

from __future__ import annotations

from core.batchfile.request import RequestKind

# OpenAI's create-chat-completion body (the openai SDK's ``CompletionCreateParams``; a test
# checks each name is one of its fields).
OPENAI_CHAT = (
    "model",
    "messages",
    "audio",
    "frequency_penalty",
    "function_call",
    "functions",
    "logit_bias",
    "logprobs",
    "max_completion_tokens",
    "max_tokens",
    "metadata",
    "modalities",
    "moderation",
    "n",
    "parallel_tool_calls",
    "prediction",
    "presence_penalty",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "reasoning_effort",
    "response_format",
    "safety_identifier",
    "seed",
    "service_tier",
    "stop",
    "store",
    "stream",
    "stream_options",
    "temperature",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "user",
    "verbosity",
    "web_search_options",
)

# OpenAI's (legacy) create-completion body.
OPENAI_COMPLETIONS = (
    "model",
    "prompt",
    "best_of",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
)

# OpenAI's create-embeddings body.
OPENAI_EMBEDDINGS = ("model", "input", "dimensions", "encoding_format", "user")

# OpenAI's create-response body.
OPENAI_RESPONSES = (
    "model",
    "input",
    "access_programs",
    "background",
    "background_options",
    "context_management",
    "conversation",
    "image",
    "include",
    "instructions",
    "max_output_tokens",
    "max_tool_calls",
    "metadata",
    "moderation",
    "parallel_tool_calls",
    "previous_response_id",
    "prompt",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "reasoning",
    "safety_identifier",
    "service_tier",
    "store",
    "stream",
    "stream_options",
    "temperature",
    "text",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "truncation",
    "user",
)

# vLLM's sampling extensions, honoured by the engine on chat and completions.
VLLM_SAMPLING = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "guided_json",
    "guided_regex",
    "guided_choice",
)

# vLLM's chat-only extension: variables for the model's chat template.
VLLM_CHAT = ("chat_template_kwargs",)

# Beyond OpenAI and vLLM alike: structured output on completions (vLLM takes it too).
COMPLETIONS_EXTRA = ("response_format",)

FIELDS: dict[RequestKind, tuple[str, ...]] = {
    "chat": OPENAI_CHAT + VLLM_SAMPLING + VLLM_CHAT,
    "completion": OPENAI_COMPLETIONS + VLLM_SAMPLING + COMPLETIONS_EXTRA,
    "embedding": OPENAI_EMBEDDINGS,
    "response": OPENAI_RESPONSES,
}

# Fields that change the operator's service or bill rather than the request's answer. A line
# for an upstream model (forwarded as written) may not carry them, unless the operator allows
# them for that upstream (``allow_fields=`` in its spec, core.llms.specs); each says why.
UPSTREAM_RESERVED: dict[str, str] = {
    "priority": "would let batch lines overtake the live traffic the upstream serves",
    "service_tier": "chooses the upstream's service tier, which the operator pays for",
    "store": "asks the upstream to keep the request and its answer",
    "request_id": "sets the id the upstream logs and bills the request under",
    "kv_transfer_params": "steers the upstream's KV cache transfer between its servers",
    "vllm_xargs": "passes extra arguments to the upstream's own plugins",
}

_NOT_SUPPORTED = "is not supported by this service"
_ALONE = "is not supported in a batch: each request stands alone"

# Fields of FIELDS that a local model refuses when set (``unsupported_parameter``, with the
# reason); a line forwarded to an upstream model carries them as written. Fields whose
# values are limited (``stream`` must be false, ``n`` at most 128, ...) are checked for
# both. docs/api.md's field table is generated from these lists (core.batchfile.field_table).
REFUSED: dict[RequestKind, dict[str, str]] = {
    "chat": {
        "logit_bias": _NOT_SUPPORTED,
        "functions": "is not supported by this service: use body.tools",
        "function_call": "is not supported by this service: use body.tool_choice",
        "web_search_options": _NOT_SUPPORTED,
        "moderation": _NOT_SUPPORTED,
        "audio": "is not supported: the models served here generate text only",
    },
    "completion": {
        "logit_bias": _NOT_SUPPORTED,
        "suffix": _NOT_SUPPORTED,
    },
    "embedding": {},
    "response": {
        "tools": "is not supported on /v1/responses: use /v1/chat/completions for tools",
        "reasoning": "is not supported: the models served here do not reason",
        "include": _NOT_SUPPORTED,
        "moderation": _NOT_SUPPORTED,
        "image": _NOT_SUPPORTED,
        "context_management": _NOT_SUPPORTED,
        "access_programs": _NOT_SUPPORTED,
    },
}

# Fields refused on every model, upstream ones too: they ask for what a batch line is not.
REFUSED_EVERYWHERE: dict[RequestKind, dict[str, str]] = {
    "chat": {},
    "completion": {},
    "embedding": {},
    "response": {
        "previous_response_id": _ALONE,
        "conversation": _ALONE,
        "prompt": _ALONE,
    },
}
