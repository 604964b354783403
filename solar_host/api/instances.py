"""REST routes for instances: thin adapters over the instance service."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response

from solar_host.estimates.accounting import instance_memory
from solar_host.instances import flight
from solar_host.instances.errors import InstanceError, InstanceNotFound, StartFailed
from solar_host.instances.schemas import Instance, InstanceCreate, InstanceResponse, InstanceUpdate

router = APIRouter(prefix="/instances", tags=["instances"])


def _svc(request: Request) -> Any:
    return request.app.state.host.instances


def error_response(err: InstanceError) -> JSONResponse:
    return JSONResponse(status_code=err.status, content=err.body())


def _answer(
    request: Request, inst: Instance, message: str, warnings: list[str] | None = None
) -> JSONResponse:
    svc = _svc(request)
    body: dict[str, Any] = {"instance": svc.instance_json(inst), "message": message}
    if warnings:
        body["warnings"] = warnings
    return JSONResponse(body)


@router.post("", response_model=InstanceResponse)
async def create_instance(request: Request, body: InstanceCreate) -> Response:
    warnings: list[str] = []
    try:
        inst = await _svc(request).create(
            body.config,
            priority=body.priority.value if body.priority else None,
            managed_by=body.managed_by,
            intent_id=body.intent_id,
            warnings=warnings,
        )
    except InstanceError as err:
        return error_response(err)
    return _answer(request, inst, f"Instance {inst.id} created successfully", warnings)


@router.get("", response_model=list[Instance])
async def list_instances(request: Request) -> Response:
    return Response(_svc(request).list_json(), media_type="application/json")


@router.get("/quarantined")
async def quarantined_instances(request: Request) -> Response:
    """config.json entries that no longer validate (an unknown backend_type, a field an upgrade
    made stricter): kept verbatim in the file, not loaded, their backends left alone. Each has
    `id`, `index` (position in the file), `reason`, `pid` (recorded backend) and `entry`.
    Fix the entry in config.json and restart, or DELETE /instances/{id} to drop it."""
    return JSONResponse(_svc(request).quarantined())


@router.get("/{instance_id}", response_model=Instance)
async def get_instance(request: Request, instance_id: str) -> Response:
    svc = _svc(request)
    try:
        return JSONResponse(svc.instance_json(svc.get(instance_id)))
    except InstanceError as err:
        return error_response(err)


@router.put("/{instance_id}", response_model=InstanceResponse)
async def update_instance(request: Request, instance_id: str, body: InstanceUpdate) -> Response:
    fields = {k: getattr(body, k) for k in body.model_fields_set}
    warnings: list[str] = []
    try:
        inst = await _svc(request).update(instance_id, fields, warnings)
    except InstanceError as err:
        return error_response(err)
    return _answer(request, inst, f"Instance {instance_id} updated successfully", warnings)


@router.delete("/{instance_id}", response_model=InstanceResponse)
async def delete_instance(request: Request, instance_id: str) -> Response:
    svc = _svc(request)
    try:
        inst = await svc.delete(instance_id)
    except InstanceNotFound as err:
        if svc.store.quarantined_entry(instance_id) is None:
            return error_response(err)
        try:
            entry = await svc.delete_quarantined(instance_id)
        except InstanceError as err2:
            return error_response(err2)
        message = f"Quarantined entry {instance_id} deleted successfully"
        return JSONResponse({"quarantined": entry, "message": message})
    except InstanceError as err:
        return error_response(err)
    return _answer(request, inst, f"Instance {instance_id} deleted successfully")


@router.post(
    "/{instance_id}/start",
    response_model=InstanceResponse,
    responses={500: {"description": "Flat {detail, instance_id, exit_code, log_tail}"}},
)
async def start_instance(request: Request, instance_id: str) -> Response:
    try:
        inst = await _svc(request).start(instance_id)
    except InstanceError as err:
        return error_response(err)
    return _answer(request, inst, f"Instance {instance_id} started successfully")


@router.post("/{instance_id}/stop", response_model=InstanceResponse)
async def stop_instance(request: Request, instance_id: str) -> Response:
    try:
        inst = await _svc(request).stop(instance_id)
    except InstanceError as err:
        return error_response(err)
    return _answer(request, inst, f"Instance {instance_id} stopped successfully")


@router.post("/{instance_id}/restart", response_model=InstanceResponse)
async def restart_instance(request: Request, instance_id: str) -> Response:
    try:
        inst = await _svc(request).restart(instance_id)
    except StartFailed as err:
        body = err.body()
        body["detail"] = f"Failed to restart instance: {err.reason}"
        return JSONResponse(status_code=500, content=body)
    except InstanceError as err:
        return error_response(err)
    return _answer(request, inst, f"Instance {instance_id} restarted successfully")


@router.get("/{instance_id}/logs")
async def instance_logs(
    request: Request,
    instance_id: str,
    limit: int | None = Query(
        default=None, ge=1, le=1_000_000, description="Newest lines to return (default: all kept)."
    ),
) -> Response:
    try:
        return JSONResponse(await _svc(request).logs(instance_id, limit))
    except InstanceError as err:
        return error_response(err)


@router.get("/{instance_id}/flight-records")
async def instance_flight_records(request: Request, instance_id: str) -> Response:
    """Why its backend ended unasked or a start attempt failed, oldest first (the newest 50),
    kept after the instance is deleted, as its logs are."""
    svc = _svc(request)
    records = await asyncio.to_thread(flight.read, svc.settings.log_dir, instance_id)
    if records is None:
        if instance_id not in svc.supervisors:
            return error_response(InstanceNotFound(instance_id))
        records = []
    return JSONResponse({"instance_id": instance_id, "records": records})


@router.get("/{instance_id}/state")
async def instance_state(request: Request, instance_id: str) -> Response:
    try:
        sup = _svc(request).supervisor(instance_id)
    except InstanceNotFound as err:
        return error_response(err)
    return JSONResponse(sup.telemetry.snapshot())


def _parse_after(value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise HTTPException(400, f"Invalid 'after' timestamp: '{value}'") from None
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


@router.get("/{instance_id}/last-generation")
async def last_generation(
    request: Request,
    instance_id: str,
    after: str | None = Query(default=None, description="ISO-8601 timestamp"),
    within_s: float | None = Query(default=None, ge=-1, le=10**9),
) -> Response:
    try:
        sup = _svc(request).supervisor(instance_id)
    except InstanceNotFound as err:
        return error_response(err)
    record, reason = sup.telemetry.last_generation(_parse_after(after), within_s)
    if record is None:
        return JSONResponse(status_code=404, content={"detail": reason})
    return JSONResponse(record)


@router.get("/{instance_id}/usage")
async def instance_usage(request: Request, instance_id: str) -> Response:
    try:
        sup = _svc(request).supervisor(instance_id)
    except InstanceNotFound as err:
        return error_response(err)
    memory = await asyncio.to_thread(instance_memory, request.app.state.host, sup.instance)
    if sup.telemetry.usage is None and memory is None:
        return JSONResponse(status_code=404, content={"detail": "No usage metrics available"})
    return JSONResponse(
        {"instance_id": instance_id, **(sup.telemetry.usage or {}), "memory": memory}
    )
