"""``/v1/models``: the served model names (``BATCHD_MODELS``), LoRA adapters with their base as
``parent``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.deps import CurrentKey, SettingsDep
from api.errors import not_found
from api.routes.envelopes import error_responses
from api.schemas import ModelList, ModelPublic
from core.llms import specs

router = APIRouter(prefix="/models", tags=["models"])


def _model(request: Request, name: str, spec: str, models: dict[str, str]) -> ModelPublic:
    kind = specs.kind_of(spec)
    adapter = specs.adapters(models).get(name) if specs.is_lora(spec) else None
    return ModelPublic(
        id=name,
        created=request.app.state.started_at,
        # A simulated model (load tests) says so: it generates filler, not answers; an upstream
        # model is served by another server; an adapter by its base's.
        owned_by=_owner(models[adapter.base] if adapter is not None else spec),
        root=adapter.root if adapter is not None else name,
        parent=adapter.base if adapter is not None else None,
        kind=kind,
        endpoints=list(specs.endpoints(spec)),
    )


def _owner(spec: str) -> str:
    if specs.is_sim(spec):
        return specs.SIM_OWNER
    if specs.is_upstream(spec):
        return specs.UPSTREAM_OWNER
    return "batchd"


@router.get("", response_model=ModelList, responses=error_responses(), summary="List models")
def list_models(request: Request, _caller: CurrentKey, settings: SettingsDep) -> ModelList:
    models = settings.models
    return ModelList(data=[_model(request, name, spec, models) for name, spec in models.items()])


@router.get(
    "/{model_id:path}",
    response_model=ModelPublic,
    responses=error_responses(404),
    summary="Retrieve a model",
)
def retrieve_model(
    model_id: str, request: Request, _caller: CurrentKey, settings: SettingsDep
) -> ModelPublic:
    if model_id not in settings.models:
        raise not_found("Model", model_id)
    return _model(request, model_id, settings.models[model_id], settings.models)
