"""The payloads the host sends to solar-control (control-contract 1.5, 3.1, 3.4, 3.5).

Built from the services at the moment of sending, never cached: control replaces its whole
copy with every list it receives, so each one must be the current truth. Any service may be
absent (a host built without jobs or resources); the payloads then leave its part out rather
than send a null control would choke on (contract section 6, items 4, 5 and 17).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from typing import Any

from solar_host import __version__
from solar_host.events import iso_now
from solar_host.resources.probes import disk_info, memory_info

log = logging.getLogger(__name__)

RUNNING = "running"


def _text(value: Any) -> str:
    return value.value if hasattr(value, "value") else str(value)


def _iso(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def instance_entry(instance: Any) -> dict[str, Any]:
    """The flat entry of contract 3.1. alias, supported_endpoints and backend_type are never
    null: one null there stops control's gateway registry refresh for every host."""
    config = instance.config
    backend_type = getattr(config, "backend_type", None) or "llamacpp"
    entry: dict[str, Any] = {
        "id": instance.id,
        "alias": getattr(config, "alias", None) or "",
        "status": _text(instance.status),
        "port": instance.port,
        "supported_endpoints": list(instance.supported_endpoints or []),
        "served_model_name": instance.served_model_name,
        "capabilities": (
            list(instance.capabilities) if instance.capabilities is not None else None
        ),
        "backend_type": backend_type,
        "priority": _text(instance.priority) if instance.priority else "production",
        "managed_by": instance.managed_by,
        "intent_id": instance.intent_id,
        "model_source": getattr(config, "model_source", None),
        "created_at": _iso(instance.created_at),
    }
    if backend_type == "llamacpp":
        ctx = getattr(config, "ctx_size", None)
        if isinstance(ctx, int):
            entry["ctx_size"] = ctx
    return entry


class PayloadBuilder:
    """Reads the host's services to build each payload."""

    def __init__(self, host: Any) -> None:
        self.host = host

    # --- facts -------------------------------------------------------------------------------

    def instances(self) -> list[Any]:
        service = self.host.instances
        return list(service.list()) if service is not None else []

    def instance_entries(self) -> list[dict[str, Any]]:
        return [instance_entry(i) for i in self.instances()]

    def roles(self) -> list[str]:
        """Never empty: `roles: []` in host_health clears the roles control placed by."""
        roles = ["inference"]
        jobs = self.host.jobs
        if jobs is not None and jobs.available:
            roles.append("training")
        return roles

    def supported_backends(self) -> list[str]:
        service = self.host.instances
        if service is None:
            return []
        return list(service.supported_backends())

    def gpu_type(self) -> str:
        try:
            return self.host.probe.gpu_type()
        except Exception as err:
            log.warning("gpu type probe failed: %s", err)
            return "cpu"

    # --- payloads ----------------------------------------------------------------------------

    def registration(self) -> dict[str, Any]:
        return {
            "host_name": self.host.settings.effective_host_name,
            "instances": self.instance_entries(),
            "roles": self.roles(),
            "gpu_type": self.gpu_type(),
            "supported_backends": self.supported_backends(),
            "version": __version__,
        }

    def instances_update(self) -> dict[str, Any]:
        return {"timestamp": iso_now(), "data": {"instances": self.instance_entries()}}

    async def host_health(self) -> dict[str, Any]:
        instances = self.instances()
        data: dict[str, Any] = {
            "roles": self.roles(),
            "supported_backends": self.supported_backends(),
            "version": __version__,
            "instance_count": len(instances),
            "running_instance_count": sum(1 for i in instances if _text(i.status) == RUNNING),
        }
        # Off the loop: NVML answers in milliseconds, or in NVML_TIMEOUT_S when a GPU is lost,
        # and a statvfs of a hung network mount does not answer at all (every 10 s).
        data.update(await asyncio.to_thread(self._readings))
        return {"timestamp": iso_now(), "data": data}

    def _readings(self) -> dict[str, Any]:
        """What host_health reads from the machine (the probe, the disk, the capacity
        snapshot). Blocking: call it through asyncio.to_thread."""
        data: dict[str, Any] = {"gpu_type": self.gpu_type()}
        memory = memory_info(self.host.probe)
        if memory is not None:  # a partial MemoryInfo would poison control's host row
            data["memory"] = memory
        disk = disk_info(self.host.probe, self.host.settings.models_dir)
        if disk is not None:
            data["disk_total_gb"] = disk["total_gb"]
            data["disk_used_gb"] = disk["used_gb"]
            data["disk_available_gb"] = disk["available_gb"]
        resources = self.host.resources
        if resources is not None:
            try:
                data["resources"] = resources.snapshot()
                data["reservations"] = resources.health_summary()
            except Exception as err:
                log.warning("resource snapshot for host_health failed: %s", err)
                data.pop("resources", None)
        return data
