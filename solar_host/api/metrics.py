"""GET /metrics: the host's Prometheus exposition (behind the API key unless METRICS_PUBLIC)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response

router = APIRouter(tags=["system"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}},
)
async def metrics(request: Request) -> Response:
    """Prometheus text format: instances, starts, crashes, pulls, control link, capacity, jobs."""
    service = request.app.state.host.metrics
    if service is None:
        raise HTTPException(503, "Metrics are not enabled on this host")
    from solar_host.metrics.families import CONTENT_TYPE

    # Rendering reads the probe (NVML, psutil per backend process): off the event loop, which
    # a hung NVML would otherwise stop for every request.
    body = await asyncio.to_thread(service.render)
    return Response(body, media_type=CONTENT_TYPE)
