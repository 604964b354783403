"""Resource routes: the capacity snapshot and the reservation ledger (control-contract 3.4)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse

from solar_host.resources.ledger import (
    CapacityExceeded,
    DimensionUnreadable,
    LedgerNotPersisted,
    ReservationNotFound,
    ReservationRunning,
)
from solar_host.resources.schemas import (
    CapacityExceededBody,
    ReleasedBody,
    ReservationRequest,
    ReservationView,
    ResourceSnapshot,
)

router = APIRouter(tags=["resources"])


def _service(request: Request) -> Any:
    service = request.app.state.host.resources
    if service is None:
        raise HTTPException(503, "Resource manager unavailable")
    return service


@router.get("/resources", response_model=ResourceSnapshot)
async def get_resources(request: Request) -> dict[str, Any]:
    """Capacity per dimension and every reservation (the same body as host_health.resources)."""
    # The snapshot reads the probe (NVML hangs when a GPU falls off the bus): off the loop.
    return await asyncio.to_thread(_service(request).snapshot)


@router.post(
    "/resources/reservations",
    status_code=201,
    response_model=ReservationView,
    responses={
        409: {"model": CapacityExceededBody, "description": "Not enough capacity"},
        503: {"description": "A dimension asked for cannot be read now; nothing reserved"},
        507: {"description": "The reservation store could not be written; nothing reserved"},
    },
)
async def create_reservation(body: ReservationRequest, request: Request) -> Any:
    """Pre-claim capacity for a job. 409 (flat body) when a dimension lacks room. Answered once
    the reservation is on disk (a host restart keeps it). 503 when the GPUs, memory or disk
    it asks for cannot be read now (it could not be checked)."""
    try:
        return await _service(request).reserve(body)
    except CapacityExceeded as err:
        return JSONResponse(status_code=409, content=err.body())
    except DimensionUnreadable as err:
        return JSONResponse(
            status_code=503, content={"detail": str(err), "dimension": err.dimension}
        )
    except LedgerNotPersisted as err:
        return JSONResponse(status_code=507, content={"detail": str(err)})


@router.delete(
    "/resources/reservations/{reservation_id}",
    response_model=ReleasedBody,
    responses={
        404: {"description": "Unknown id"},
        409: {"description": "Its job is running"},
        507: {"description": "The reservation store could not be written; nothing released"},
    },
)
async def release_reservation(reservation_id: str, request: Request) -> Any:
    try:
        return await _service(request).unreserve(reservation_id)
    except ReservationNotFound as err:
        raise HTTPException(404, str(err)) from None
    except ReservationRunning as err:
        raise HTTPException(409, str(err)) from None
    except LedgerNotPersisted as err:
        return JSONResponse(status_code=507, content={"detail": str(err)})
