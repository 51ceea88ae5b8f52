"""Field checks shared by every endpoint's body."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

from core.batchfile.request import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_SEQUENCES,
    BatchRequest,
    LineError,
    show,
    type_name,
)


class Checker:
    """Reads and checks the fields of one request body; each failure is a :class:`LineError`
    naming the line and the field."""

    def __init__(self, line: int, body: dict[str, Any], *, forwarded: bool = False):
        self.line = line
        self.body = body
        # the body goes as written to an upstream model, which decides what it serves: the
        # fields only local models refuse (fields.REFUSED) pass
        self.forwarded = forwarded

    def fail(self, code: str, param: str, message: str) -> LineError:
        return LineError(self.line, code, message, param)

    def type_error(self, param: str, expected: str, value: Any) -> LineError:
        return self.fail(
            "invalid_type", param, f"{param} must be {expected}, got {type_name(value)}"
        )

    def required(self, param: str, value: Any) -> Any:
        """``value``, unless it is absent: then the ``missing_required_param`` error."""
        if value is None:
            raise self.fail("missing_required_param", param, f"{param} is required")
        return value

    def choice(self, param: str, value: Any, choices: Collection[str]) -> Any:
        """``value``, unless it is not one of ``choices``: then the error that lists them."""
        if value not in choices:
            raise self.fail(
                "invalid_value",
                param,
                f"{param} must be one of {', '.join(choices)}, got {show(value)}",
            )
        return value

    def get(self, name: str) -> Any:
        return self.body.get(name)

    def number(
        self, name: str, lo: float, hi: float, default: float, *, lo_open: bool = False
    ) -> float:
        value = self.get(name)
        param = f"body.{name}"
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.type_error(param, "a number", value)
        value = float(value)
        if math.isnan(value) or value > hi or value < lo or (lo_open and value == lo):
            rng = (
                f"greater than {lo:g} and at most {hi:g}"
                if lo_open
                else f"between {lo:g} and {hi:g}"
            )
            raise self.fail("invalid_value", param, f"{param} must be {rng}, got {value:g}")
        return value

    def integer(self, name: str, lo: int | None, hi: int | None, default: Any) -> Any:
        value = self.get(name)
        param = f"body.{name}"
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer() and not isinstance(value, bool):
            value = int(value)  # 16.0 is an integer in JSON's eyes
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.type_error(param, "an integer", value)
        if lo is not None and hi is not None and not lo <= value <= hi:
            raise self.fail(
                "invalid_value", param, f"{param} must be between {lo} and {hi}, got {value}"
            )
        if lo is not None and value < lo:
            raise self.fail("invalid_value", param, f"{param} must be at least {lo}, got {value}")
        if hi is not None and value > hi:
            raise self.fail("invalid_value", param, f"{param} must be at most {hi}, got {value}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.type_error(f"body.{name}", "a boolean", value)
        return value

    def stop(self) -> list[str]:
        value = self.get("stop")
        param = "body.stop"
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        elif not isinstance(value, list):
            raise self.type_error(param, "a string or an array of strings", value)
        if len(value) > MAX_STOP_SEQUENCES:
            raise self.fail(
                "invalid_value",
                param,
                f"{param} may hold at most {MAX_STOP_SEQUENCES} sequences, got {len(value)}",
            )
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise self.type_error(f"{param}[{i}]", "a string", item)
            if not item:
                raise self.fail("invalid_value", f"{param}[{i}]", f"{param}[{i}] must not be empty")
        return list(value)

    def known(self, fields: Collection[str]) -> None:
        """Refuse a body holding a field outside ``fields`` (``unknown_parameter``, in OpenAI's
        words, naming every such field; ``param`` is the first)."""
        unknown = [name for name in self.body if name not in fields]
        if not unknown:
            return
        names = [name if len(name) <= 64 else name[:61] + "..." for name in unknown[:5]]
        if len(unknown) > 5:
            names.append(f"and {len(unknown) - 5} more")
        plural = "s" if len(unknown) > 1 else ""
        raise self.fail(
            "unknown_parameter",
            f"body.{names[0]}",
            f"Unrecognized request argument{plural} supplied: {', '.join(names)}",
        )

    def token_ids(self, name: str) -> list[int]:
        """An array of token ids (integers of at least 0); absent is empty."""
        value = self.get(name)
        param = f"body.{name}"
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.type_error(param, "an array of token ids", value)
        for i, tok in enumerate(value):
            if isinstance(tok, bool) or not isinstance(tok, int):
                raise self.type_error(f"{param}[{i}]", "an integer token id", tok)
            if tok < 0:
                raise self.fail(
                    "invalid_value", f"{param}[{i}]", f"{param}[{i}] must be at least 0, got {tok}"
                )
        return list(value)

    def refuse_unserved(self, names: Mapping[str, str]) -> None:
        """Refuse each of ``names`` that is set (``unsupported_parameter``, with its reason),
        unless the body is forwarded to an upstream model."""
        if self.forwarded:
            return
        for name, why in names.items():
            self.reject_if_set(name, why)

    def reject_if_set(self, name: str, why: str = "is not supported by this service") -> None:
        value = self.get(name)
        if value is not None and value != [] and value != {}:
            raise self.fail("unsupported_parameter", f"body.{name}", f"body.{name} {why}")

    def common(self, req: BatchRequest) -> None:
        """Sampling fields shared by both endpoints (everything but logprobs and max_tokens)."""
        if self.get("stream") is not None and self.boolean("stream", False):
            raise self.fail(
                "unsupported_value",
                "body.stream",
                "body.stream must be false: batch requests cannot be streamed",
            )
        req.temperature = self.number("temperature", 0.0, 2.0, 1.0)
        req.top_p = self.number("top_p", 0.0, 1.0, 1.0, lo_open=True)
        top_k = self.integer("top_k", -1, None, 0)
        req.top_k = 0 if top_k == -1 else top_k
        req.n = self.integer("n", 1, 128, 1)
        req.stop = self.stop()
        req.seed = self.integer("seed", -(2**63), 2**64 - 1, None)
        req.presence_penalty = self.number("presence_penalty", -2.0, 2.0, 0.0)
        req.frequency_penalty = self.number("frequency_penalty", -2.0, 2.0, 0.0)
        req.ignore_eos = self.boolean("ignore_eos", False)

    def vllm_sampling(self, req: BatchRequest) -> None:
        """vLLM's sampling extensions beyond :meth:`common`'s ``top_k`` and ``ignore_eos``
        (structured output: :func:`core.batchfile.bodies.structured.guided`). Read after
        ``req.max_tokens``: ``min_tokens`` may not exceed it."""
        req.min_p = self.number("min_p", 0.0, 1.0, 0.0)
        req.repetition_penalty = self.number(
            "repetition_penalty", 0.0, MAX_REPETITION_PENALTY, 1.0, lo_open=True
        )
        req.min_tokens = self.integer("min_tokens", 0, None, 0)
        limit = req.max_tokens
        if limit is None and req.kind == "completion":
            limit = COMPLETIONS_DEFAULT_MAX_TOKENS
        if limit is not None and req.min_tokens > limit:
            bound = (
                f"body.{req.max_tokens_from} ({limit})"
                if req.max_tokens is not None
                else f"{limit}, the default max_tokens of completions"
            )
            raise self.fail(
                "invalid_value",
                "body.min_tokens",
                f"body.min_tokens must be at most {bound}, got {req.min_tokens}",
            )
        req.stop_token_ids = self.token_ids("stop_token_ids")
        req.skip_special_tokens = self.boolean("skip_special_tokens", True)
