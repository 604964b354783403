"""System routes: service info, health (public), memory, and the control-link nudge."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response
from pydantic import BaseModel

from solar_host import __version__
from solar_host.api.hotpaths import health_body
from solar_host.resources.probes import memory_info

router = APIRouter(tags=["system"])


class MemoryInfo(BaseModel):
    used_gb: float
    total_gb: float
    available_gb: float | None = None
    percent: float
    memory_type: str


@router.get("/")
async def root(request: Request) -> dict[str, Any]:
    host = request.app.state.host
    return {
        "service": "solar-host",
        "version": __version__,
        "description": "Process manager for model inference backends "
        "(llama.cpp, HuggingFace, SGLang)",
        "supported_backends": host.instances.supported_backends(),
        "backends": host.instances.backend_availability(),
    }


@router.get("/health")
async def health(request: Request) -> Response:
    return Response(health_body(request.app.state.host), media_type="application/json")


@router.get(
    "/memory",
    response_model=MemoryInfo,
    responses={503: {"description": "Memory information not available"}},
)
async def memory(request: Request) -> dict[str, Any]:
    # NVML answers in NVML_TIMEOUT_S at worst (a lost GPU): off the loop.
    info = await asyncio.to_thread(memory_info, request.app.state.host.probe)
    if info is None:
        raise HTTPException(503, "Memory information not available")
    return info


@router.post(
    "/reconnect",
    responses={503: {"description": "No control link configured, or it cannot reconnect now"}},
)
async def reconnect(request: Request) -> dict[str, str]:
    host = request.app.state.host
    control = host.control
    if control is None:
        raise HTTPException(503, "No solar-control client configured")
    from solar_host.control.client import ControlLinkUnavailable

    try:
        return {"status": await control.reconnect()}
    except ControlLinkUnavailable as err:
        raise HTTPException(503, str(err)) from None
