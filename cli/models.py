"""The served models as the local processes load them: demo presets built ahead of use."""

from __future__ import annotations


def resolve_models(models: dict[str, str]) -> dict[str, str]:
    """Build demo models named ``demo:<preset>`` ahead of the first request; other specs are
    returned as they are."""
    from engine.demo_models import build

    resolved = {}
    for name, spec in models.items():
        resolved[name] = str(build(spec.split(":", 1)[1])) if spec.startswith("demo:") else spec
    return resolved
