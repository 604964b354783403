"""Instance commands over the socket (ruling 5: our extension for hosts control cannot reach
over HTTP). Each command calls exactly the instance-service method the REST route calls and
answers through the Socket.IO ack: `{ok: true, instance}` or `{ok: false, status, detail}`,
with the same status and detail REST would give."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from solar_host.instances.errors import InstanceError
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


def failure(status: int, detail: Any, **extra: Any) -> dict[str, Any]:
    return {"ok": False, "status": status, "detail": detail, **extra}


def _validation_detail(err: ValidationError) -> list[dict[str, Any]]:
    return [
        {"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
        for e in err.errors(include_url=False, include_context=False, include_input=False)
    ]


def _instance_id(data: dict[str, Any]) -> str | None:
    value = data.get("instance_id")
    return value if isinstance(value, str) and value else None


async def run_command(instances: Any, name: str, data: Any) -> dict[str, Any]:
    """Run one command and return the ack body. Never raises."""
    if name not in COMMANDS:
        return failure(400, f"Unknown command: {name}")
    if instances is None:
        return failure(503, "Instance service not available")
    if not isinstance(data, dict):
        return failure(400, "payload must be a JSON object")
    try:
        if name == "create_instance":
            try:
                body = InstanceCreate.model_validate(
                    {
                        k: data[k]
                        for k in ("config", "priority", "managed_by", "intent_id")
                        if k in data
                    }
                )
            except ValidationError as err:
                return failure(422, _validation_detail(err))
            instance = await instances.create(
                body.config,
                priority=body.priority.value if body.priority else None,
                managed_by=body.managed_by,
                intent_id=body.intent_id,
            )
        else:
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
        body = err.body()
        detail = body.pop("detail", str(err))
        return failure(err.status, detail, **body)
    except Exception as err:  # the ack must always come back
        log.exception("socket command %s failed", name)
        return failure(500, f"Internal error: {type(err).__name__}: {err}")
    return {"ok": True, "instance": instance.model_dump(mode="json")}
