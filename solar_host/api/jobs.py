"""The /jobs routes (intended caller: solar-control). A thin layer over JobService.

The body is validated here rather than by FastAPI's 422 handler so a bad job gets the README's
400 with the offending field named (`steps: ...`, `steps.0.gpu: ...`).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from solar_host.jobs.schemas import (
    STEP_FIELD_ERROR,
    JobDefinition,
    JobStateResponse,
    JobSubmitted,
    validate_slug,
)
from solar_host.jobs.service import (
    DockerUnavailable,
    GpuUnavailable,
    JobExists,
    JobFinished,
    JobNotFound,
    JobNotPersisted,
    JobService,
)
from solar_host.jobs.workspace import InsufficientDiskError, WorkspaceError
from solar_host.platform.textsafe import CONTROL_CHARS_RE, refusal, unstorable

router = APIRouter(tags=["jobs"])


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """JobDefinition's JSON schema with $defs inlined (it is embedded in the OpenAPI doc)."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return walk(defs[ref.split("/")[-1]])
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


def _body_schema() -> dict[str, Any]:
    schema = _inline_refs(JobDefinition.model_json_schema())
    # Every GPU form of ruling 13 is accepted; the schema says so instead of only the object.
    for step in [schema["properties"]["steps"]["items"]]:
        step["properties"]["gpu"] = {
            "description": "{count: N} (-1 = all), {device_ids: [...]}, an int, a list of ids, "
            "or true (legacy: all GPUs)",
            "anyOf": [
                {"type": "object"},
                {"type": "integer"},
                {"type": "array", "items": {"type": "string"}},
                {"type": "boolean"},
                {"type": "null"},
            ],
        }
    return schema


def _service(request: Request) -> JobService:
    return request.app.state.host.jobs


def _field_errors(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e.get("loc", ()) if p not in ("function-after",))
        msg = str(e.get("msg", "invalid"))
        msg = msg.removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


@router.post(
    "/jobs",
    status_code=202,
    response_model=JobSubmitted,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _body_schema()}},
        }
    },
    responses={
        400: {"description": "Invalid job_id, steps, step names or GPU request"},
        409: {"description": "A job with this job_id exists"},
        422: {"description": "A step field the host does not implement or refuses"},
        503: {"description": "No Docker daemon is reachable"},
        507: {"description": "Insufficient disk space"},
    },
)
async def submit_job(request: Request) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw) if raw else None
    except (ValueError, RecursionError):  # deep nesting overflows the parser
        raise HTTPException(400, "body: not valid JSON") from None
    if not isinstance(data, dict):
        raise HTTPException(400, "body: a JSON object (JobDefinition) is required")
    bad = unstorable(data)
    if bad is not None:  # no Unicode text: the container would get something else (U+FFFD)
        raise HTTPException(400, refusal(bad, "body"))
    try:
        job = JobDefinition.model_validate(data)
    except ValidationError as err:
        # A step field the host does not implement (or refuses) is a 422, other bad input 400.
        refused = any(e.get("type") == STEP_FIELD_ERROR for e in err.errors())
        raise HTTPException(422 if refused else 400, _field_errors(err)) from None
    if job.name is not None and CONTROL_CHARS_RE.search(job.name):
        # Checked here, not in the model: a job stored by an older release loads as it is.
        raise HTTPException(400, "name: name must not contain control characters")
    service = _service(request)
    try:
        state = await service.submit(job)
    except GpuUnavailable as err:
        raise HTTPException(400, err.detail) from None
    except DockerUnavailable:
        raise HTTPException(
            503,
            {"error": "executor_unavailable", "message": "No Docker daemon is reachable"},
        ) from None
    except JobExists as err:
        raise HTTPException(409, str(err)) from None
    except InsufficientDiskError as err:
        raise HTTPException(
            507,
            {
                "error": "insufficient_storage",
                "required_gb": err.required_gb,
                "available_gb": err.available_gb,
            },
        ) from None
    except JobNotPersisted as err:
        raise HTTPException(507, {"error": "not_persisted", "message": str(err)}) from None
    except WorkspaceError as err:
        raise HTTPException(500, {"error": "workspace_create_failed", "reason": str(err)}) from None
    body = JobSubmitted(
        job_id=state.job_id,
        status=state.status,
        workspace_path=state.workspace_path,
        submission_id=state.submission_id,
        correlation_id=state.correlation_id,
    )
    return JSONResponse(body.model_dump(mode="json"), status_code=202)


@router.get("/jobs", response_model=list[JobStateResponse])
async def list_jobs(request: Request) -> list[dict[str, Any]]:
    """Every job without step logs (recent_logs empty; GET /jobs/{id} has them): control
    reads job_id and status here, and the logs of every retained job made it megabytes."""
    service = _service(request)
    return [service.view(j, logs=False) for j in service.list()]


def _known(job_id: str) -> str:
    try:
        return validate_slug(job_id, "job_id")
    except ValueError:
        return ""


@router.get(
    "/jobs/{job_id}",
    response_model=JobStateResponse,
    responses={404: {"description": "Unknown job_id"}},
)
async def get_job(job_id: str, request: Request) -> dict[str, Any]:
    service = _service(request)
    job = service.get(job_id) if _known(job_id) else None
    if job is None:
        raise HTTPException(404, f"Job '{job_id}' not found")
    return service.view(job)


@router.delete(
    "/jobs/{job_id}",
    responses={
        404: {"description": "Unknown job_id"},
        409: {"description": "The job already finished"},
    },
)
async def cancel_job(job_id: str, request: Request) -> dict[str, str]:
    service = _service(request)
    try:
        if not _known(job_id):
            raise JobNotFound(f"Job '{job_id}' not found")
        await service.cancel(job_id)
    except JobNotFound as err:
        raise HTTPException(404, str(err)) from None
    except JobFinished as err:
        raise HTTPException(409, str(err)) from None
    return {"detail": "cancelled", "job_id": job_id}
