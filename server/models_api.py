"""`POST /models/load` and `POST /models/unload` (`{"model": NAME}`), as llama-server's router mode
takes them, under the API key like /v1: a model loaded ahead of its first request, or unloaded
when idle (a 409 while it runs requests: nothing is cut). Each answers the model's entry as
`/v1/models` shows it."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from server.errors import BODY_FIELDS

router = APIRouter(prefix="/models")


class ModelAction(BaseModel):
    """The body of both routes."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(..., min_length=1, max_length=512, description="a model's name, as GET /v1/models lists it")


BODY_FIELDS["/models/load"] = BODY_FIELDS["/models/unload"] = list(ModelAction.model_fields)


def _card(registry, entry) -> dict:
    return next(card for card in registry.snapshot() if card["id"] == entry.name)


@router.post("/load", summary="Load a model now (it serves at once when already loaded)")
async def load_model(body: ModelAction, request: Request):
    registry = request.app.state.models
    entry = await registry.load(body.model)
    return {"success": True, "model": _card(registry, entry)}


@router.post("/unload", summary="Unload an idle model (409 while it runs requests or is pinned)")
async def unload_model(body: ModelAction, request: Request):
    registry = request.app.state.models
    entry = await registry.unload(body.model)
    return {"success": True, "model": _card(registry, entry)}
