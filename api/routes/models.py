"""``/v1/models``: the served model names (``BATCHD_MODELS``)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.deps import CurrentKey, SettingsDep
from api.errors import not_found
from api.routes.common import error_responses
from api.schemas import ModelList, ModelPublic

router = APIRouter(prefix="/models", tags=["models"])


def _model(request: Request, name: str) -> ModelPublic:
    return ModelPublic(id=name, created=request.app.state.started_at)


@router.get("", response_model=ModelList, responses=error_responses(), summary="List models")
def list_models(request: Request, _caller: CurrentKey, settings: SettingsDep) -> ModelList:
    return ModelList(data=[_model(request, name) for name in settings.models])


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
    return _model(request, model_id)
