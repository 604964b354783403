"""Memory estimate routes: `POST /instances/estimate` (a config in, nothing created) and
`GET /instances/{id}/estimate`. Both answer the per-device breakdown in bytes beside what each
device has available now; a config that cannot be estimated is a 422 naming the field."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from solar_host.estimates.model import EstimateError
from solar_host.instances.errors import InstanceError
from solar_host.instances.states import ACTIVE

router = APIRouter(prefix="/instances", tags=["instances"])


class EstimateRequest(BaseModel):
    config: dict[str, Any] = Field(description="Backend config, as for POST /instances.")


class DeviceBreakdown(BaseModel):
    device: str = Field(description="cpu (system RAM) or cuda:N.")
    weights_bytes: int
    kv_cache_bytes: int
    compute_bytes: int
    extra_files_bytes: int = Field(description="mmproj and speculative draft model.")
    total_bytes: int
    available_bytes: int | None = Field(
        description="Free now, less reservations and the estimates of loading instances."
    )
    fits: bool


class EstimateResponse(BaseModel):
    backend_type: str
    devices: list[DeviceBreakdown]
    total_bytes: int
    fits: bool
    placement: list[str] = Field(description="Devices a start now would use.")
    notes: list[str]
    refusal: str | None = None
    instance_id: str | None = None
    source: str = Field(
        description="What a start is admitted with: 'measured' (the peak of an earlier load "
        "of this config plus MEASURED_MEMORY_MARGIN) or 'estimated' (never measured)."
    )
    admitted_bytes: int = Field(description="The figure the fit check uses.")
    estimated_bytes: int = Field(description="The estimate (total_bytes).")
    measured_bytes: int | None = Field(
        description="The measured peak of an earlier load of this config, without margin; "
        "null when never measured."
    )
    admitted_devices: dict[str, int] | None = Field(
        default=None, description="Per device, what is admitted when source is 'measured'."
    )


def _unprocessable(err: EstimateError, prefix: list[str]) -> JSONResponse:
    detail = [{**e, "loc": [*prefix, *e["loc"]]} for e in err.errors()]
    return JSONResponse(status_code=422, content={"detail": detail})


def _gate(request: Request) -> Any:
    return request.app.state.host.instances.capacity


@router.post("/estimate", response_model=EstimateResponse)
async def estimate_config(request: Request, body: EstimateRequest) -> Response:
    svc = request.app.state.host.instances
    try:
        config, _ = await svc.parse(body.config)
    except InstanceError as err:
        return JSONResponse(status_code=err.status, content=err.body())
    try:
        doc = await asyncio.to_thread(_gate(request).estimate_view, "", config)
    except EstimateError as err:
        return _unprocessable(err, ["body", "config"])
    except InstanceError as err:  # GpusUnreadable: the GPUs of this GPU host cannot be read
        return JSONResponse(status_code=err.status, content=err.body())
    return JSONResponse(doc)


@router.get("/{instance_id}/estimate", response_model=EstimateResponse)
async def instance_estimate(request: Request, instance_id: str) -> Response:
    svc = request.app.state.host.instances
    try:
        inst = svc.get(instance_id)
    except InstanceError as err:
        return JSONResponse(status_code=err.status, content=err.body())
    try:
        placed = inst.status in ACTIVE
        doc = await asyncio.to_thread(
            _gate(request).estimate_view, instance_id, inst.config, placed=placed
        )
    except EstimateError as err:
        return _unprocessable(err, ["config"])
    except InstanceError as err:  # GpusUnreadable: the GPUs of this GPU host cannot be read
        return JSONResponse(status_code=err.status, content=err.body())
    doc["instance_id"] = instance_id
    return JSONResponse(doc)
