"""The workloads every benchmark, ``batchd bench`` and ``batchd tune`` run.

One type (:class:`Workload`, prompt token ids and output lengths) made from a real JSONL batch
file, chat questions through the model's template, or named length distributions (``fixed:N``,
``uniform:LO:HI``, ``lognormal:MEAN:SIGMA``, samples clipped to [1, 4 * MEAN]); and from the
same generators the service benchmarks' request lines (:func:`completion_lines`,
:func:`chat_bodies`, :func:`sampled_lines`).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.batchfile.request import RequestKind, max_tokens_field

# The synthetic workload's lengths unless told otherwise (a long tail, as real traffic has).
DEFAULT_INPUT_LEN = "lognormal:128:0.8"
DEFAULT_OUTPUT_LEN = "lognormal:64:0.8"
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"


@dataclass(frozen=True)
class LengthDist:
    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        parts = text.split(":")
        try:
            if parts[0] == "fixed" and len(parts) == 2:
                dist = cls("fixed", int(parts[1]))
            elif parts[0] == "uniform" and len(parts) == 3:
                dist = cls("uniform", int(parts[1]), int(parts[2]))
            elif parts[0] == "lognormal" and len(parts) == 3:
                dist = cls("lognormal", float(parts[1]), float(parts[2]))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"bad length distribution {text!r}: use fixed:N, uniform:LO:HI or "
                "lognormal:MEAN:SIGMA"
            ) from None
        if dist.a < 1 or (dist.kind == "uniform" and dist.b < dist.a) or dist.b < 0:
            raise ValueError(f"bad length distribution {text!r}: lengths must be >= 1, LO <= HI")
        return dist

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        mu = math.log(self.a) - self.b**2 / 2  # so that the mean is self.a
        return int(min(max(1, round(rng.lognormvariate(mu, self.b))), 4 * self.a))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        return f"lognormal:{self.a:g}:{self.b:g}"


@dataclass
class Workload:
    """Prompts (token ids) and output lengths: what the engine alone runs. ``description`` says
    where they came from (``source``: ``synthetic``, ``chat`` or a file's path, and the
    parameters that made them)."""

    prompts: list[list[int]]
    max_tokens: list[int]
    description: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def source(self) -> str:
        """The workload in a few words, for reports."""
        d = self.description
        if d.get("source") == "synthetic":
            return f"synthetic input {d['input_len']}, output {d['output_len']}"
        return str(d.get("source", ""))

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    @property
    def mean_prompt(self) -> float:
        return self.prompt_tokens / max(1, len(self.prompts))

    @property
    def mean_output(self) -> float:
        return self.output_tokens / max(1, len(self.max_tokens))


def request_line(custom_id: str, body: dict[str, Any], url: str = CHAT_URL) -> dict[str, Any]:
    """One line of an OpenAI batch input file."""
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def usable_token_ids(tokenizer: Any, vocab_size: int) -> list[int]:
    special = set(tokenizer.all_special_ids or [])
    return [i for i in range(vocab_size) if i not in special]


def synthetic_workload(
    *,
    num_requests: int,
    input_len: LengthDist,
    output_len: LengthDist,
    vocab: Sequence[int],
    max_model_len: int,
    seed: int = 0,
    shared_prefix_frac: float = 0.0,
) -> Workload:
    """``num_requests`` random prompts and output lengths drawn from the two distributions
    (both fit ``max_model_len``), the same for the same seed; ``shared_prefix_frac`` of each
    prompt is a prefix all prompts share (what prefix caching saves)."""
    if not 0.0 <= shared_prefix_frac <= 1.0:
        raise ValueError(f"--shared-prefix-frac must be in [0, 1], got {shared_prefix_frac}")
    rng = random.Random(seed)
    lengths = []
    for _ in range(num_requests):
        out = max(1, min(output_len.sample(rng), max_model_len - 1))
        inp = max(1, min(input_len.sample(rng), max_model_len - out))
        lengths.append((inp, out))
    longest = max((i for i, _ in lengths), default=0)
    prefix = [rng.choice(vocab) for _ in range(longest)]
    prompts = []
    for inp, _ in lengths:
        shared = int(round(shared_prefix_frac * inp))
        prompts.append(prefix[:shared] + [rng.choice(vocab) for _ in range(inp - shared)])
    return Workload(
        prompts=prompts,
        max_tokens=[out for _, out in lengths],
        description={
            "source": "synthetic",
            "num_requests": num_requests,
            "input_len": str(input_len),
            "output_len": str(output_len),
            "shared_prefix_frac": shared_prefix_frac,
            "seed": seed,
        },
    )


# Chat requests for benchmarks on real models: ordinary questions through the model's chat
# template, as a batch of user prompts reaches the engine (36 prompt tokens on average with
# SmolLM2's template, a few system prompts shared between requests).
_SYSTEMS = (
    None,
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in a few sentences.",
    "You are a patient teacher who explains things simply to a curious student.",
)
_ASKS = (
    "Explain",
    "Write a short poem about",
    "Give three facts about",
    "Summarise what you know about",
    "Tell a short story about",
    "List some uses of",
    "Describe",
    "Why do people care about",
    "What are common mistakes people make with",
    "Compare two opinions on",
)
_TOPICS = (
    "the sea",
    "a CPU",
    "Paris",
    "sleep",
    "boiled eggs",
    "the moon",
    "rain",
    "coffee",
    "bicycles",
    "volcanoes",
    "libraries",
    "honey bees",
    "chess",
    "winter",
    "bread",
    "trains",
    "gardens",
    "the internet",
    "rivers",
    "music",
)


# Filler words for chat prompts of a drawn length (``chat_bodies(words=…)``).
FILLER_WORDS = (
    "the quick brown fox jumps over a lazy dog while batch requests stream through one model "
    "token by token and every shard keeps the engine busy until nothing is left to run"
).split()


def chat_bodies(
    n: int,
    max_tokens: int | LengthDist,
    seed: int = 0,
    *,
    words: LengthDist | None = None,
    model: str | None = None,
) -> list[dict[str, Any]]:
    """``n`` chat request bodies (``messages``, ``max_tokens``), the same for the same seed.

    Without ``words`` each asks an ordinary question (a few system prompts shared between
    requests). With ``words`` the user message is that many filler words drawn from the
    distribution, numbered so no two prompts are alike, and three in ten have a short system
    prompt. ``max_tokens`` is a number or a distribution drawn per request; ``model`` is set
    when given."""
    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        if words is None:
            system = rng.choice(_SYSTEMS)
            user = f"{rng.choice(_ASKS)} {rng.choice(_TOPICS)}."
            out = max_tokens if isinstance(max_tokens, int) else max_tokens.sample(rng)
        else:
            count = words.sample(rng)
            out = max_tokens if isinstance(max_tokens, int) else max_tokens.sample(rng)
            user = f"{i}: " + " ".join(rng.choice(FILLER_WORDS) for _ in range(count))
            system = "Answer briefly." if rng.random() < 0.3 else None
        messages = [{"role": "user", "content": user}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        body: dict[str, Any] = {"messages": messages, "max_tokens": out}
        if model is not None:
            body = {"model": model, **body}
        bodies.append(body)
    return bodies


def completion_lines(workload: Workload, model: str, id_prefix: str) -> list[dict[str, Any]]:
    """``workload`` as ``/v1/completions`` request lines: token-id prompts, greedy,
    ``ignore_eos``, so each request has exactly its prompt and output lengths."""
    return [
        request_line(
            f"{id_prefix}{i}",
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": out,
                "temperature": 0,
                "ignore_eos": True,
            },
            COMPLETIONS_URL,
        )
        for i, (prompt, out) in enumerate(zip(workload.prompts, workload.max_tokens, strict=True))
    ]


def sampled_lines(
    rows: Sequence[dict[str, Any]], rng: random.Random, n: int, model: str, id_prefix: str
) -> list[dict[str, Any]]:
    """``n`` request lines drawn at random from a real batch file's rows
    (:func:`iter_request_bodies`), each a copy with ``model`` set: the file's shapes."""
    out = []
    for i in range(n):
        row = json.loads(json.dumps(rng.choice(rows)))
        body = row.get("body", row)
        body["model"] = model
        url = row.get("url") or (CHAT_URL if "messages" in body else COMPLETIONS_URL)
        out.append(request_line(f"{id_prefix}{i}", body, url))
    return out


def iter_request_bodies(path: Path) -> list[dict[str, Any]]:
    """The request lines of a JSONL file: OpenAI batch lines (``{"body": …}``) or bare
    bodies (``{"messages" | "prompt", "max_tokens"}``), as parsed dicts."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: not a JSON object")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows


def request_shape(
    row: dict[str, Any], tokenizer: Any, max_model_len: int, default_max_tokens: int
) -> tuple[list[int], int] | None:
    """A request's prompt token ids (chat prompts through the model's chat template, as the
    service tokenizes them) and output length, the prompt cut from the left so both fit
    ``max_model_len``; None when it has neither ``messages`` nor ``prompt``. ``row`` is an
    OpenAI batch line (``{"body": …}``) or a bare body."""
    body = row.get("body", row)
    if "messages" in body:
        ids = tokenizer.apply_chat_template(
            body["messages"], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
    elif "prompt" in body:
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            ids = list(prompt)
        else:
            ids = tokenizer.encode(prompt if isinstance(prompt, str) else prompt[0])
    else:
        return None
    kind: RequestKind = "chat" if "messages" in body else "completion"
    out = body.get(max_tokens_field(kind, body)) or default_max_tokens
    out = max(1, min(int(out), max_model_len - 1))
    return list(ids)[-(max_model_len - out) :] or [0], out


def jsonl_workload(
    path: Path,
    tokenizer: Any,
    *,
    max_model_len: int,
    default_max_tokens: int = 256,
    limit: int | None = None,
) -> Workload:
    """Prompt token ids and ``max_tokens`` of the requests in a JSONL batch file (the first
    ``limit``): OpenAI batch lines (``body.messages`` or ``body.prompt``) or bare bodies."""
    prompts, outs = [], []
    for line_no, row in enumerate(iter_request_bodies(path)[:limit], 1):
        shape = request_shape(row, tokenizer, max_model_len, default_max_tokens)
        if shape is None:
            raise ValueError(f"{path}: request {line_no} has no 'messages' or 'prompt'")
        prompts.append(shape[0])
        outs.append(shape[1])
    return Workload(prompts, outs, {"source": str(path), "num_requests": len(prompts)})


def chat_workload(
    tokenizer: Any, *, num_requests: int, output_len: int, max_model_len: int, seed: int
) -> Workload:
    """Chat requests (:func:`chat_bodies`) rendered by the model's chat template, as the
    service renders them."""
    shapes = [
        request_shape(body, tokenizer, max_model_len, output_len)
        for body in chat_bodies(num_requests, output_len, seed)
    ]
    return Workload(
        prompts=[s[0] for s in shapes if s is not None],
        max_tokens=[s[1] for s in shapes if s is not None],
        description={
            "source": "chat",
            "num_requests": num_requests,
            "output_len": output_len,
            "seed": seed,
        },
    )
