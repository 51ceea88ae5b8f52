"""Field checks shared by every endpoint's body."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

from core.batch_request import MAX_STOP_SEQUENCES, BatchRequest, LineError, show, type_name


class Checker:
    """Reads and checks the fields of one request body; each failure is a :class:`LineError`
    naming the line and the field."""

    def __init__(self, line: int, body: dict[str, Any]):
        self.line = line
        self.body = body

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
        self.reject_if_set("logit_bias")
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
