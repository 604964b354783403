"""Instance commands over the socket (ruling 5: our extension for hosts control cannot reach
over HTTP). Each command calls exactly the instance-service method the REST route calls and
answers through the Socket.IO ack, always exactly once:

* `{ok: true, instance}` on success (`existing: true` added when a create named an id that is
  already there: a retried create never makes a second instance);
* `{ok: false, status, detail, error: {code, message}}` otherwise, with the status and detail
  REST would give, plus a stable machine-readable code.

A `CommandRunner` bounds the work a sender can start: payloads above CONTROL_MAX_COMMAND_BYTES
and commands beyond CONTROL_MAX_COMMANDS_IN_FLIGHT are refused at once with an answer
(`payload_too_large`, `busy`), never with silence, so a sender can tell "refused" from "lost".
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from solar_host.instances.errors import InstanceConflict, InstanceError, StartFailed
from solar_host.instances.schemas import InstanceCreate, InstanceUpdate

log = logging.getLogger(__name__)

COMMANDS = (
    "start_instance",
    "stop_instance",
    "restart_instance",
    "update_instance",
    "create_instance",
    "delete_instance",
)
_SIMPLE = {
    "start_instance": "start",
    "stop_instance": "stop",
    "restart_instance": "restart",
    "delete_instance": "delete",
}
UPDATE_FIELDS = ("config", "managed_by", "intent_id")
CREATE_FIELDS = ("config", "priority", "managed_by", "intent_id")
# An id a sender may choose for a create: what is safe in a URL path and a log line.
INSTANCE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")

_CODES = {
    400: "invalid_request",
    404: "not_found",
    409: "conflict",
    413: "payload_too_large",
    422: "invalid_body",
    500: "internal_error",
    503: "unavailable",
    507: "not_persisted",
}


def _message(detail: Any) -> str:
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):  # FastAPI-style validation errors
        parts = []
        for e in detail[:5]:
            if isinstance(e, dict):
                loc = ".".join(str(p) for p in e.get("loc", []) if p != "body")
                parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        return "; ".join(parts) or "invalid request"
    return str(detail)


def failure(status: int, detail: Any, *, code: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "ok": False,
        "status": status,
        "detail": detail,
        "error": {"code": code or _CODES.get(status, "error"), "message": _message(detail)},
        **extra,
    }


def _validation_detail(err: ValidationError) -> list[dict[str, Any]]:
    return [
        {"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
        for e in err.errors(include_url=False, include_context=False, include_input=False)
    ]


def _instance_id(data: dict[str, Any]) -> str | None:
    value = data.get("instance_id")
    return value if isinstance(value, str) and value else None


def payload_size(obj: Any, limit: int) -> int:
    """About the JSON size of `obj`, counted only until it passes `limit` (a 3 MB payload costs
    a walk of its first megabyte, not an encoding of all of it)."""
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, dict):
            total += 2
            for key, value in item.items():
                total += len(key) + 4 if isinstance(key, str) else 8
                stack.append(value)
        elif isinstance(item, (list, tuple)):
            total += 2 + len(item)
            if total > limit:  # before copying a list of millions onto the stack
                break
            stack.extend(item)
        elif isinstance(item, (bytes, bytearray)):
            total += len(item)
        else:
            total += 8
        if total > limit:
            break
    return total


class CommandRunner:
    """Runs socket commands against the instance service, bounded in size and concurrency."""

    def __init__(self, instances: Callable[[], Any], *, max_in_flight: int, max_bytes: int) -> None:
        self._instances = instances
        self.max_in_flight = max_in_flight
        self.max_bytes = max_bytes
        self.in_flight = 0
        self.refused_busy = 0
        self.refused_size = 0
        self.refused_unknown = 0
        # Creates that named an id, while they run: a retry of one waits for its answer.
        self._creating: dict[str, asyncio.Future[dict[str, Any]]] = {}

    async def run(self, name: str, data: Any) -> dict[str, Any]:
        """Run one command and return the ack body. Never raises."""
        if name not in COMMANDS:
            self.refused_unknown += 1
            return failure(400, f"Unknown command: {name[:100]!r}", code="unknown_command")
        size = payload_size(data, self.max_bytes)
        if size > self.max_bytes:
            self.refused_size += 1
            return failure(413, f"{name} payload is larger than {self.max_bytes} bytes")
        if self.in_flight >= self.max_in_flight:
            self.refused_busy += 1
            return failure(
                503,
                f"Too many commands in flight ({self.max_in_flight}); retry later",
                code="busy",
            )
        self.in_flight += 1
        try:
            return await self._run(name, data)
        except Exception as err:  # the ack must always come back
            log.exception("socket command %s failed", name)
            return failure(500, f"Internal error: {type(err).__name__}: {err}")
        finally:
            self.in_flight -= 1

    async def _run(self, name: str, data: Any) -> dict[str, Any]:
        instances = self._instances()
        if instances is None:
            return failure(503, "Instance service not available")
        if not isinstance(data, dict):
            return failure(400, "payload must be a JSON object")
        try:
            if name == "create_instance":
                return await self._create(instances, data)
            instance_id = _instance_id(data)
            if instance_id is None:
                return failure(400, "instance_id is required (a non-empty string)")
            if name == "update_instance":
                present = {k: data[k] for k in UPDATE_FIELDS if k in data}
                try:
                    InstanceUpdate.model_validate(present)
                except ValidationError as err:
                    return failure(422, _validation_detail(err))
                instance = await instances.update(instance_id, present)
            else:
                instance = await getattr(instances, _SIMPLE[name])(instance_id)
        except InstanceError as err:
            return _instance_failure(err)
        return {"ok": True, "instance": instance.model_dump(mode="json")}

    async def _create(self, instances: Any, data: dict[str, Any]) -> dict[str, Any]:
        wanted = data.get("instance_id")
        if wanted is not None and not (isinstance(wanted, str) and INSTANCE_ID.fullmatch(wanted)):
            return failure(
                422,
                [
                    {
                        "loc": ["instance_id"],
                        "msg": "must be 1-128 characters of letters, digits and ._:- "
                        "starting with a letter or digit",
                        "type": "value_error",
                    }
                ],
            )
        try:
            body = InstanceCreate.model_validate({k: data[k] for k in CREATE_FIELDS if k in data})
        except ValidationError as err:
            return failure(422, _validation_detail(err))
        if wanted is None:
            return await _create_answer(instances, body, None)

        running = self._creating.get(wanted)
        if running is not None:  # the same create, retried while the first one runs
            answer = await asyncio.shield(running)
            return {**answer, "existing": True} if answer.get("ok") else answer
        existing = _existing(instances, wanted)
        if existing is not None:
            return {"ok": True, "instance": existing.model_dump(mode="json"), "existing": True}
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._creating[wanted] = future
        answer: dict[str, Any]
        try:
            answer = await _create_answer(instances, body, wanted)
        except Exception as err:
            answer = failure(500, f"Internal error: {type(err).__name__}: {err}")
            log.exception("socket create of %s failed", wanted)
        except BaseException:  # cancelled (link stopping): a waiting retry still gets an answer
            future.set_result(failure(503, "Create interrupted; retry", code="unavailable"))
            raise
        finally:
            del self._creating[wanted]
        future.set_result(answer)
        return answer


async def _create_answer(instances: Any, body: Any, instance_id: str | None) -> dict[str, Any]:
    """Create the instance (with the caller's id, if any); an id that exists answers with it."""
    try:
        instance = await instances.create(
            body.config,
            priority=body.priority.value if body.priority else None,
            managed_by=body.managed_by,
            intent_id=body.intent_id,
            instance_id=instance_id,
        )
    except InstanceConflict as err:
        existing = _existing(instances, instance_id) if instance_id is not None else None
        if existing is None:
            return _instance_failure(err)
        return {"ok": True, "instance": existing.model_dump(mode="json"), "existing": True}
    except InstanceError as err:
        return _instance_failure(err)
    return {"ok": True, "instance": instance.model_dump(mode="json")}


def _existing(instances: Any, instance_id: str) -> Any:
    try:
        return instances.get(instance_id)
    except InstanceError:
        return None


def _instance_failure(err: InstanceError) -> dict[str, Any]:
    body = err.body()
    detail = body.pop("detail", str(err))
    code = "start_failed" if isinstance(err, StartFailed) else None
    return failure(err.status, detail, code=code, **body)
