"""GET /metrics: the host's Prometheus exposition (behind the API key unless METRICS_PUBLIC)."""

from __future__ import annotations

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
    service = request.app.state.host.services.get("metrics")
    if service is None:
        raise HTTPException(503, "Metrics are not enabled on this host")
    from solar_host.metrics import CONTENT_TYPE

    return Response(service.render(), media_type=CONTENT_TYPE)
