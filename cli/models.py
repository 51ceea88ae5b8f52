"""The served models as the local processes load them: demo presets built and GGUF files
converted ahead of use."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def resolve_models(
    models: dict[str, str], say: Callable[[str], None] | None = None
) -> dict[str, str]:
    """Build demo models named ``demo:<preset>`` and convert GGUF files (``gguf:<file>``, a
    package that ships one) ahead of the first request, once: both are cached, so the worker
    then loads them in seconds and two processes never race to make them. Other specs are
    returned as they are. A model whose files cannot be served (or whose package is not
    installed), or a LoRA adapter whose directory is no peft adapter directory, raises
    ``ModelSourceError`` naming it; ``say`` reports a conversion (slow)."""
    from core.llms import gguf, specs
    from core.llms.demo import build

    try:
        specs.adapters(models)  # a LoRA entry with no base, naming it
    except ValueError as exc:
        raise gguf.ModelSourceError(str(exc)) from None
    resolved = {}
    for name, spec in models.items():
        if specs.is_lora(spec):  # a LoRA adapter: its directory, read now (the base loads it)
            try:
                adapter_dir = specs.lora_spec(spec, name).path
                if adapter_dir is not None:
                    specs.check_adapter_dir(adapter_dir)
            except ValueError as exc:
                raise gguf.ModelSourceError(
                    f"BATCHD_MODELS entry {name!r} ({spec}): {exc}"
                ) from None
            resolved[name] = spec
            continue
        if specs.is_upstream(spec):
            try:
                upstream = specs.upstream_spec(spec, name)
            except ValueError as exc:
                raise gguf.ModelSourceError(f"model {name!r}: {exc}") from None
            if upstream.key_env and upstream.key_env not in os.environ:
                raise gguf.ModelSourceError(
                    f"model {name!r}: its key_env {upstream.key_env} is not set in the environment"
                )
            resolved[name] = spec
            continue
        if spec.startswith("demo:"):
            resolved[name] = str(build(spec.split(":", 1)[1]))
            continue
        try:
            path = gguf.gguf_file(spec)
            if path is not None:
                resolved[name] = str(gguf.converted_dir(path, say=say))
                continue
            if spec.startswith("pkg:"):
                specs.package_dir(spec)  # an installed package, or say how to install
        except ValueError as exc:
            raise gguf.ModelSourceError(f"model {name!r} ({spec}): {exc}") from exc
        resolved[name] = spec
    return resolved


def describe(name: str, spec: str, path: str) -> str:
    """One line for ``batchd up``: the served name, its spec and where it loads from."""
    from core.llms import gguf, specs

    if specs.is_upstream(spec):
        return f"model {name!r}: {specs.upstream_spec(spec, name).describe()}"
    if path == spec:
        return f"model {name!r}: {spec}"
    info = gguf.conversion_info(Path(path))
    if info is None:
        return f"model {name!r}: {spec} ({path})"
    return (
        f"model {name!r}: {spec} = {info.get('source')}, de-quantised to {info.get('dtype')}, "
        f"cached in {path}"
    )


def local_model_dir(model: str, say: Callable[[str], None] | None = None) -> str:
    """The model directory ``model`` names for an engine in this process (``batchd run``): a
    local directory, a GGUF file (converted once, cached), a spec (``demo:``, ``gguf:``,
    ``pkg:``) or a name ``BATCHD_MODELS`` serves."""
    from core.llms import specs
    from core.settings import get_settings

    if Path(model).expanduser().is_dir():
        return model
    spec = get_settings().models.get(model, model)
    resolved = resolve_models({model: spec}, say=say)[model]
    if resolved.startswith("pkg:"):
        return str(specs.package_dir(resolved))
    return resolved
