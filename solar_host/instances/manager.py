"""The instance service: records, their supervisors, persistence, boot and shutdown.

The REST routes and the Socket.IO commands both call these methods; nothing here knows about
either. Reads are snapshots; `list_json()` caches the serialized list, because solar-control
polls `GET /instances` every second or two for hosts it cannot see over the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from solar_host.backends.base import HostFacts
from solar_host.backends.registry import BackendRegistry
from solar_host.events import EventBus, InstancesChanged
from solar_host.instances import adoption, boot, ownership
from solar_host.instances import process as procs
from solar_host.instances.config_check import ConfigCheck
from solar_host.instances.context import SupervisorContext
from solar_host.instances.errors import (
    InstanceConflict,
    InstanceNotFound,
    InvalidInstanceConfig,
    NotPersisted,
)
from solar_host.instances.httpcheck import ProbePacer
from solar_host.instances.logs import (
    IdleLogBuffers,
    InotifyHub,
    file_mtime_iso,
    files_of,
    prune_log_files,
    tail_lines,
)
from solar_host.instances.ports import PortAllocator
from solar_host.instances.schemas import (
    Instance,
    Priority,
)
from solar_host.instances.states import ACTIVE, InstanceStatus
from solar_host.instances.store import InstanceStore, LoadResult, StoredInstance
from solar_host.instances.supervisor import Supervisor
from solar_host.platform.logging_setup import Redactor
from solar_host.platform.statefiles import private_dir
from solar_host.resources.probes import SystemProbe
from solar_host.settings import Settings

if TYPE_CHECKING:
    from solar_host.estimates.capacity import CapacityGate

log = logging.getLogger(__name__)
S = InstanceStatus
DEFAULT_ROLES = ["inference"]


class InstanceManager:
    def __init__(
        self,
        *,
        settings: Settings,
        bus: EventBus,
        backends: BackendRegistry,
        probe: SystemProbe,
        api_key: Callable[[], str],
    ):
        self.settings = settings
        self.bus = bus
        self.backends = backends
        self.probe = probe
        self.api_key = api_key
        self.store = InstanceStore(settings.config_file, settings.models_dir)
        self.supervisors: dict[str, Supervisor] = {}
        self.idle_logs = IdleLogBuffers(settings.retained_log_buffers)
        self.roles = list(DEFAULT_ROLES)
        self.ports = PortAllocator(settings.start_port, self._held_ports)
        self.probe_pacer = ProbePacer()  # readiness probes of every starting backend
        self.manifest_lookup: Callable[[str], Path | None] | None = None
        self.configs = ConfigCheck(
            settings=settings,
            backends=backends,
            api_key=api_key,
            facts=self.facts,
            manifest_lookup=lambda: self.manifest_lookup,
        )
        # What every supervisor may use of the host (never the manager itself).
        self.ctx = SupervisorContext(
            settings=settings,
            bus=bus,
            backends=backends,
            ports=self.ports,
            idle_logs=self.idle_logs,
            probe_pacer=self.probe_pacer,
            api_key=api_key,
            facts=self.facts,
            marker=self.marker,
            key_hash=self.key_hash,
            changed=self.changed,
            persist=self.persist,
            persist_or_raise=self.persist_or_raise,
            persist_soon=self.persist_soon,
            prune_logs_soon=self.prune_logs_soon,
            backend_redactor=self.backend_redactor,
            ports_kept_by_others=self._ports_kept_by_others,
        )
        self._facts: HostFacts | None = None
        self._list_cache: bytes | None = None
        self._journaled: dict[str, str] = {}  # instance id -> the status last logged (_journal)
        self._boot_task: asyncio.Task[None] | None = None
        self._prune_task: asyncio.Task[Any] | None = None
        self._sweep_task: asyncio.Task[None] | None = None
        self._facts_task: asyncio.Future[None] | None = None
        self.boot_done = asyncio.Event()
        self._pending_saves: set[asyncio.Task[None]] = set()
        # Set by a hand-over restart (Host.hand_over_backends): the coming shutdown leaves
        # every backend serving for the next host process, whatever KEEP_BACKENDS_ON_SHUTDOWN.
        self.hand_over = False
        # This state directory's id (ownership.load_host_id): part of every backend's marker.
        self.host_id = ""
        self._loaded: LoadResult | None = None

    @property
    def capacity(self) -> CapacityGate | None:
        """The capacity gate (set by build_host); the supervisors read it from their context."""
        return self.ctx.capacity

    @capacity.setter
    def capacity(self, gate: CapacityGate | None) -> None:
        self.ctx.capacity = gate

    @property
    def inotify(self) -> InotifyHub | None:
        return self.ctx.inotify

    def marker(self, instance_id: str) -> str:
        return ownership.marker(self.host_id, instance_id)

    def key_hash(self, key: str) -> str:
        return ownership.key_fingerprint(self.host_id, key)

    # --- lifecycle of the service ----------------------------------------------------------------

    async def load_state(self) -> None:
        """Read config.json before any service starts: a file that cannot be parsed stops the
        host (StateFileError) before anything is written or any process touched."""
        self._loaded = await asyncio.to_thread(self.store.load)
        self.host_id = await asyncio.to_thread(self._load_host_id, self._loaded)

    def _load_host_id(self, loaded: Any) -> str:
        """The host id, checked against the markers config.json recorded (load_host_id)."""
        markers = [r.process.marker for r in loaded.records if r.process is not None]
        markers += [q.marker for q in self.store.quarantined]
        recorded = ownership.recorded_host_ids(markers)
        if self.store.on_disk is None:  # no config.json: a first start, or one gone missing
            ownership.check_missing_config(self.settings.config_file)
        return ownership.load_host_id(self.settings.config_file, recorded)

    async def startup(self) -> None:
        """Service start: load records, re-adopt or boot-start backends (in the background)."""
        result, self._loaded = self._loaded, None
        if result is None:
            result = await asyncio.to_thread(self.store.load)
            self.host_id = await asyncio.to_thread(self._load_host_id, result)
        private_dir(self.settings.log_dir, 0o750)
        self.settings.models_dir.mkdir(parents=True, exist_ok=True)
        self.ctx.inotify = InotifyHub()
        # Off the start-up path (it looks for executables and Python packages).
        self._facts_task = asyncio.create_task(asyncio.to_thread(self.log_backends))
        if result.legacy:
            # Backends the previous release left serving: ended as it ended them at boot,
            # before anything starts again; here, after every state file was found good.
            from solar_host.instances import adopt_legacy

            await asyncio.to_thread(adopt_legacy.settle, result.legacy)
        if result.roles:
            self.roles = result.roles
        for stored in result.records:
            self.supervisors[stored.instance.id] = Supervisor(self.ctx, stored)
        to_start = await self._recover()
        self._boot_task = asyncio.create_task(self._boot(to_start), name="instances-boot")
        self._sweep_task = asyncio.create_task(self._log_sweeper(), name="log-retention")

    async def _recover(self) -> list[Supervisor]:
        """Re-adopt what still runs (boot.recover); return what must start again."""
        to_start, adopted = await boot.recover(list(self.supervisors.values()), self.host_id)
        # Written when re-adoption or the load changed anything (an older format, a backend
        # gone); a restart that finds everything as recorded writes nothing (store.on_disk).
        await self.persist()
        self._sweep_prompt_caches(adopted)
        return to_start

    async def _boot(self, to_start: list[Supervisor]) -> None:
        """Background half of boot: stop strays of ours, start what should run but does not,
        then restart (one at a time) adopted backends that hold an outdated API key."""
        try:
            await boot.sweep_strays(
                self.host_id,
                self.supervisors,
                protected_ids=self.store.protected_ids(),
                protected_pids=self.protected_pids(),
                grace_s=self.settings.stop_grace_s,
            )
        except Exception:
            log.exception("the sweep of unmanaged backends failed")
        keys = asyncio.create_task(
            boot.restart_outdated_keys(
                list(self.supervisors.values()), self.key_hash(self.api_key()), self.restart
            ),
            name="key-restarts",
        )
        await boot.start_all(to_start, self.settings.boot_start_concurrency)
        self.boot_done.set()
        await keys

    def _sweep_prompt_caches(self, adopted: list[Supervisor]) -> None:
        """Leftover SGLang caches go, after re-adoption so a live backend keeps its own."""
        root = self.settings.sglang_prompt_cache_dir
        if not root or "sglang" not in self.backends.types():
            return
        keep = [
            (s.instance.config.alias, s.id)
            for s in adopted
            if s.instance.config.backend_type == "sglang"
        ]
        try:
            self.backends.for_type("sglang").sweep_caches(root, keep)
        except Exception:
            log.exception("prompt cache sweep failed")

    async def shutdown(self) -> None:
        """Service stop: stop backends (or leave them serving) and persist."""
        for task in (self._boot_task, self._sweep_task, self._prune_task, self._facts_task):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        sups = list(self.supervisors.values())
        if self.settings.keep_backends_on_shutdown or self.hand_over:
            await asyncio.gather(*(s.detach() for s in sups), return_exceptions=True)
        else:
            await asyncio.gather(
                *(s.stop(forget_intent=False) for s in sups), return_exceptions=True
            )
        if self._pending_saves:
            await asyncio.gather(*self._pending_saves, return_exceptions=True)
        await self.persist()
        self.store.close()
        if self.inotify is not None:
            self.inotify.close()

    # --- facts -----------------------------------------------------------------------------------

    def facts(self) -> HostFacts:
        if self._facts is None:
            hf = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
            self._facts = HostFacts(
                gpu_type=self.probe.gpu_type(),
                llama_server_bin=self.settings.llama_server_bin,
                sglang_venv_path=self.settings.sglang_venv_path,
                hf_available=hf,
            )
        return self._facts

    def supported_backends(self) -> list[str]:
        return self.backends.supported(self.facts())

    def backend_availability(self) -> dict[str, dict[str, Any]]:
        """Per backend type: available, the executable or module it uses, why not."""
        return {bt: a.as_dict() for bt, a in self.backends.availability(self.facts()).items()}

    def log_backends(self) -> None:
        from solar_host.backends.availability import log_lines

        for line in log_lines(self.backends.availability(self.facts())):
            (log.info if ": available" in line else log.warning)("%s", line)

    # --- change notification and persistence -----------------------------------------------------

    def changed(self, instance_id: str, status: str | None, reason: str = "") -> None:
        self._list_cache = None
        self._journal(instance_id, status, reason)
        self.bus.publish(InstancesChanged(instance_id, status, reason))

    def _journal(self, instance_id: str, status: str | None, reason: str) -> None:
        """One line in the host's log per step of an instance's life (created, starting,
        running, stopping, stopped, failed, updated, deleted): what an operator reading the
        log or the journal looks for. Status updates that change no status are not steps."""
        last = self._journaled.get(instance_id)
        if status == last and reason not in ("created", "updated"):
            return
        if status is None:
            self._journaled.pop(instance_id, None)
        else:
            self._journaled[instance_id] = status
        sup = self.supervisors.get(instance_id)
        alias = sup.instance.config.alias if sup is not None else "-"
        why = f" ({reason})" if reason and reason != status else ""
        log.info("instance %s (%s): %s%s", instance_id, alias, status or "deleted", why)

    async def persist(self) -> None:
        """Save config.json; a failure is logged (used where the change already happened)."""
        try:
            await self.persist_or_raise()
        except NotPersisted as err:
            log.error("%s", err.detail)

    async def persist_or_raise(self) -> None:
        """Save config.json or raise NotPersisted (507), so the caller can undo its change."""
        records = [s.stored for s in self.supervisors.values()]
        try:
            await self.store.save(records, self.roles)
        except OSError as err:
            raise NotPersisted(
                f"Cannot write {self.store.path}: {err.strerror or err}; nothing was changed"
            ) from None
        except (ValueError, RecursionError) as err:  # a record JSON cannot hold (a bug upstream)
            log.error("cannot encode %s: %s", self.store.path, err)
            raise NotPersisted(
                f"Cannot encode {self.store.path}: {err}; nothing was changed"
            ) from None

    def persist_soon(self) -> None:
        """Persist without waiting (saves coalesce; the newest snapshot wins)."""
        task = asyncio.create_task(self.persist())
        self._pending_saves.add(task)
        task.add_done_callback(self._pending_saves.discard)

    def _held_ports(self) -> set[int]:
        # Called from the port allocator's worker thread: iterate over a copy.
        return {
            s.instance.port
            for s in list(self.supervisors.values())
            if s.instance.port is not None and s.instance.status in ACTIVE
        } | self.store.protected_ports()

    def _ports_kept_by_others(self, instance_id: str) -> set[int]:
        """The ports other instances last served on: one is never handed to another instance
        while the instance that served on it exists (ruling 24)."""
        return {
            s.stored.last_port
            for s in list(self.supervisors.values())
            if s.id != instance_id and s.stored.last_port is not None
        }

    def protected_pids(self) -> set[int]:
        """Backend pids no sweep may stop although no instance owns them: those recorded by
        quarantined config.json entries (their backend is left alone, never killed)."""
        return self.store.protected_pids()

    def prune_logs_soon(self) -> None:
        if self._prune_task is None or self._prune_task.done():
            self._prune_task = asyncio.create_task(
                asyncio.to_thread(
                    prune_log_files, self.settings.log_dir, self.settings.log_file_retention_s
                )
            )

    async def _log_sweeper(self) -> None:
        while True:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(
                    prune_log_files, self.settings.log_dir, self.settings.log_file_retention_s
                )
            await asyncio.sleep(max(60.0, min(3600.0, self.settings.log_file_retention_s / 4)))

    # --- reads -----------------------------------------------------------------------------------

    def _sup(self, instance_id: str) -> Supervisor:
        sup = self.supervisors.get(instance_id)
        if sup is None:
            raise InstanceNotFound(instance_id)
        return sup

    def get(self, instance_id: str) -> Instance:
        return self._sup(instance_id).instance

    def list(self) -> list[Instance]:
        return [s.instance for s in self.supervisors.values()]

    def instance_json(self, inst: Instance) -> dict[str, Any]:
        """An instance as the REST API shows it; config.api_key carries the key control needs
        for its HTTP-poll path (ruling 2, contract §6 trap 1)."""
        doc = inst.model_dump(mode="json")
        if not doc["config"].get("api_key"):
            doc["config"]["api_key"] = self.api_key()
        return doc

    def list_json(self) -> bytes:
        cached = self._list_cache
        if cached is None:
            cached = json.dumps(
                [self.instance_json(s.instance) for s in self.supervisors.values()],
                separators=(",", ":"),
            ).encode()
            self._list_cache = cached
        return cached

    def quarantined(self) -> list[dict[str, Any]]:
        """config.json entries that no longer validate, kept verbatim (store.QuarantinedEntry)."""
        return [q.view() for q in self.store.quarantined]

    def models_in_use(self) -> list[tuple[str, str, list[str], list[str] | None]]:
        """(id, backend_type, model paths, file_filters) of instances whose files are in use."""
        out = []
        for s in self.supervisors.values():
            inst = s.instance
            if inst.status not in ACTIVE:
                continue
            backend = self.backends.for_type(inst.config.backend_type)
            out.append(
                (
                    inst.id,
                    inst.config.backend_type,
                    backend.model_paths(inst.config),
                    inst.config.file_filters,
                )
            )
        return out

    # --- writes ----------------------------------------------------------------------------------

    async def parse(
        self, raw: Any, warnings: list[str] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """A config as given (create, update, estimate) checked and parsed, with the fields
        derived from it (config_check.ConfigCheck)."""
        return await self.configs.parse(raw, warnings)

    async def create(
        self,
        config: dict[str, Any],
        priority: str | None = None,
        managed_by: str | None = None,
        intent_id: str | None = None,
        instance_id: str | None = None,
        warnings: list[str] | None = None,
    ) -> Instance:
        """Create an instance; config warnings (unknown fields) are appended to `warnings`."""
        # A caller-chosen id (socket creates, so a retried create stays one instance): checked
        # before the parse, and again after its await (a twin create may have landed).
        if instance_id is not None and instance_id in self.supervisors:
            raise InstanceConflict(f"Instance {instance_id} already exists")
        parsed, derived = await self.parse(config, warnings)
        if instance_id is not None and instance_id in self.supervisors:
            raise InstanceConflict(f"Instance {instance_id} already exists")
        try:
            prio = Priority(priority) if priority is not None else Priority.PRODUCTION
        except ValueError:
            raise InvalidInstanceConfig(
                [
                    {
                        "loc": ["body", "priority"],
                        "msg": f"Invalid priority '{priority}'. Must be one "
                        "of: ephemeral, production, staging",
                        "type": "enum",
                    }
                ]
            ) from None
        inst = Instance(
            id=instance_id or str(uuid.uuid4()),
            config=parsed,
            status=S.STOPPED,
            created_at=datetime.now(UTC),
            priority=prio,
            managed_by=managed_by,
            intent_id=intent_id,
            **derived,
        )
        sup = Supervisor(self.ctx, StoredInstance(instance=inst))
        self.supervisors[inst.id] = sup
        # Published before the write, so the control link's instances_update is on its way
        # while config.json is written (control expects it before this call answers).
        self.changed(inst.id, inst.status.value, "created")
        try:
            await self.persist_or_raise()
        except NotPersisted:
            self.supervisors.pop(inst.id, None)
            self.changed(inst.id, None, "create undone")
            raise
        return inst

    async def update(
        self, instance_id: str, fields: dict[str, Any], warnings: list[str] | None = None
    ) -> Instance:
        sup = self._sup(instance_id)
        async with sup.lock:
            if sup.deleted:  # a delete held the lock while this call waited for it
                raise InstanceNotFound(instance_id)
            inst = sup.instance
            starting = sup.start_task is not None and not sup.start_task.done()
            if starting or inst.status not in (S.STOPPED, S.FAILED):
                raise InstanceConflict("Cannot update a running instance. Stop it first.")
            changes: dict[str, Any] = {}
            if "config" in fields and fields["config"] is not None:
                changes["config"], derived = await self.parse(fields["config"], warnings)
                changes.update(derived)
            for key in ("managed_by", "intent_id"):
                if key in fields:
                    changes[key] = fields[key]
            if "priority" in fields and fields["priority"] is not None:
                try:
                    changes["priority"] = Priority(fields["priority"])
                except ValueError:
                    raise InvalidInstanceConfig(
                        [{"loc": ["body", "priority"], "msg": "Invalid priority", "type": "enum"}]
                    ) from None
            before = {k: getattr(inst, k) for k in changes}
            for k, v in changes.items():
                setattr(inst, k, v)
            self.changed(instance_id, inst.status.value, "updated")
            try:
                await self.persist_or_raise()
            except NotPersisted:
                for k, v in before.items():
                    setattr(inst, k, v)
                self.changed(instance_id, inst.status.value, "update undone")
                raise
        return inst

    async def delete(self, instance_id: str) -> Instance:
        sup = self._sup(instance_id)
        async with sup.lock:
            if sup.deleted:  # another delete held the lock while this one waited for it
                raise InstanceNotFound(instance_id)
            starting = sup.start_task is not None and not sup.start_task.done()
            if starting or sup.instance.status not in (S.STOPPED, S.FAILED):
                raise InstanceConflict("Cannot delete a running instance. Stop it first.")
            self.supervisors.pop(instance_id, None)
            self.idle_logs.busy(instance_id)
            self.changed(instance_id, None, "deleted")
            try:
                await self.persist_or_raise()
            except NotPersisted:
                self.supervisors[instance_id] = sup
                self.changed(instance_id, sup.instance.status.value, "delete undone")
                raise
            sup.deleted = True
            sup._cancel(sup.restart_task)
            await adoption.end_recorded(
                sup.stored.process, self.marker(instance_id), self.settings.stop_grace_s
            )
            sup.stored.process = None
        sup.ring.notify()  # log streamers wake, see the instance gone, and close
        sup.after_stop_hook()
        return sup.instance

    async def delete_quarantined(self, instance_id: str) -> dict[str, Any]:
        """An operator deletes a quarantined entry: it leaves config.json, and its recorded
        backend, if that very process still runs, is stopped (as delete leaves nothing behind)."""
        entry = self.store.quarantined_entry(instance_id)
        if entry is None:
            raise InstanceNotFound(instance_id)
        self.store.quarantined.remove(entry)
        try:
            await self.persist_or_raise()
        except NotPersisted:
            self.store.quarantined.append(entry)
            raise
        log.warning("quarantined entry %s deleted by the operator", instance_id)
        # Its backend and workers, whatever its record says: what carries its marker is its own.
        ours = await asyncio.to_thread(ownership.carriers, self.marker(instance_id))
        if ours:
            await procs.end_processes(ours, self.settings.stop_grace_s)
        return entry.view()

    async def start(self, instance_id: str) -> Instance:
        inst = await self._sup(instance_id).start()
        # The answer's state is on disk before the caller hears it: a host killed right after
        # a start re-adopts that backend as running, not as still loading.
        await self.persist()
        return inst

    async def stop(self, instance_id: str) -> Instance:
        return await self._sup(instance_id).stop()

    async def restart(self, instance_id: str) -> Instance:
        sup = self._sup(instance_id)
        # One operation of the supervisor (a stop issued meanwhile cancels its start, a restart
        # issued meanwhile joins it). The intent stays "running" through the stop (and is on
        # disk before the signal): a host that dies mid-restart finishes the stop at boot and
        # then starts it again.
        inst = await sup.restart()
        await self.persist()
        return inst

    # --- logs and telemetry ----------------------------------------------------------------------

    def backend_redactor(self, instance_key: str | None) -> Redactor:
        """For backend lines that leave the machine (GET and WS .../logs, control's log_batch,
        start errors): a backend may print the keys it was given (`--api-key`). The values of
        the host's secrets and the instance's key are replaced; the field patterns of the
        host's own log are not applied (shapes=False: see Redactor)."""
        s = self.settings
        keys = (self.api_key(), instance_key, s.hf_token, s.harbor_password)
        return Redactor((k for k in keys if k), shapes=False)

    def supervisor(self, instance_id: str) -> Supervisor:
        return self._sup(instance_id)

    async def logs(self, instance_id: str, limit: int | None = None) -> list[dict[str, Any]]:
        """The last `limit` lines (default: the whole buffer): the in-memory buffer, else the
        tail of the newest log file (even after delete), read off the event loop."""
        kept = self.settings.log_buffer_size
        n = kept if limit is None else min(limit, kept)
        sup = self.supervisors.get(instance_id)
        if sup is not None and sup.ring.entries:
            return [e.as_dict() for e in sup.ring.tail(n)]
        files = await asyncio.to_thread(files_of, self.settings.log_dir, instance_id)
        if files:
            newest = files[0]
            ts = file_mtime_iso(newest)
            cap = self.settings.log_line_max_bytes
            lines = await asyncio.to_thread(tail_lines, newest, n, cap)
            # Read back as the ring holds them: with the secrets' values replaced.
            redact = self.backend_redactor(sup.instance.config.api_key if sup else None)
            return [{"seq": i, "timestamp": ts, "line": redact(ln)} for i, ln in enumerate(lines)]
        if sup is not None:
            return []
        raise InstanceNotFound(instance_id)
