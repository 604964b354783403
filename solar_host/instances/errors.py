"""Errors of the instance service. Each carries the HTTP status adapters map it to, so REST and
Socket.IO commands answer the same way."""

from __future__ import annotations

from typing import Any


class InstanceError(Exception):
    status: int = 500

    def __init__(self, detail: Any):
        self.detail = detail
        super().__init__(detail if isinstance(detail, str) else str(detail))

    def body(self) -> dict[str, Any]:
        return {"detail": self.detail}


class InstanceNotFound(InstanceError):
    status = 404

    def __init__(self, instance_id: str):
        self.instance_id = instance_id
        super().__init__("Instance not found")


class InstanceConflict(InstanceError):
    """The request is valid but the instance's state forbids it (e.g. delete while running)."""

    status = 409


class InvalidInstanceConfig(InstanceError):
    """A config failed validation; `detail` is a FastAPI-style list of {loc, msg, type}."""

    status = 422


class PortsExhausted(InstanceError):
    """No port left for a backend: the range and how many are taken, so the fix is obvious."""

    status = 503


class StartFailed(InstanceError):
    """A start ended without a serving backend: the flat body of control-contract 2.4."""

    status = 500

    def __init__(
        self,
        instance_id: str,
        reason: str,
        exit_code: int | None,
        log_tail: list[str],
        *,
        retryable: bool = True,
    ):
        self.instance_id = instance_id
        self.reason = reason
        self.exit_code = exit_code
        self.log_tail = log_tail
        self.retryable = retryable  # False: the config cannot start (trying again won't help)
        super().__init__(f"Failed to start instance: {reason}")

    def body(self) -> dict[str, Any]:
        return {
            "detail": self.detail,
            "instance_id": self.instance_id,
            "exit_code": self.exit_code,
            "log_tail": self.log_tail,
        }


class NotPersisted(InstanceError):
    """config.json could not be written (disk full, read-only): the change was undone."""

    status = 507


class StopFailed(InstanceError):
    status = 500
