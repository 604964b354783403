"""An instance config as given (create, update, estimate): parsed, checked, and the fields
derived from it.

Unknown fields are a 422 when they are a near miss of a known one (ruling 25), else warned
(solar-control may be newer than this host); fields the backend this host runs cannot honour
are a 422. Never silently dropped.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from solar_host.backends.base import HostFacts
from solar_host.backends.registry import BackendRegistry
from solar_host.instances.errors import InvalidInstanceConfig
from solar_host.instances.schemas import ConfigError, parse_config
from solar_host.settings import Settings

log = logging.getLogger(__name__)


class ConfigCheck:
    def __init__(
        self,
        *,
        settings: Settings,
        backends: BackendRegistry,
        api_key: Callable[[], str],
        facts: Callable[[], HostFacts],
        manifest_lookup: Callable[[], Callable[[str], Path | None] | None],
    ) -> None:
        self.settings = settings
        self.backends = backends
        self.api_key = api_key
        self.facts = facts
        # The model store's lookup of pulled models (set by the composition root after both
        # services exist): read at each parse.
        self.manifest_lookup = manifest_lookup

    async def parse(
        self, raw: Any, warnings: list[str] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """A config as given (create, update, estimate) checked and parsed, with the fields
        derived from it. In a worker thread: finding the model walks directories (up to
        50,000 entries), reads manifest.json and model configs, and the availability check may
        read the GPU probe, none of which may hold the event loop."""

        def work() -> tuple[Any, dict[str, Any]]:
            config = self._parse(raw, warnings=warnings)
            return config, self._derived(config)

        return await asyncio.to_thread(work)

    def _parse(
        self,
        raw: Any,
        *,
        loc_prefix: tuple[str, ...] = ("body", "config"),
        warnings: list[str] | None = None,
    ) -> Any:
        try:
            config = parse_config(
                raw,
                models_dir=self.settings.models_dir,
                strict=True,
                manifest_lookup=self.manifest_lookup(),
                roots=self.settings.model_root_dirs,
            )
        except ConfigError as err:
            raise InvalidInstanceConfig(
                [{**e, "loc": [*loc_prefix, *e["loc"]]} for e in err.errors]
            ) from None
        if config.api_key is not None and hmac.compare_digest(
            config.api_key.encode(), self.api_key().encode()
        ):
            # The host key, which GET shows in config.api_key of an instance without a key of
            # its own (instance_json): a config read, edited and put back carried it. Kept,
            # it stayed a key of that backend after the host key was changed.
            config.api_key = None
        if not (isinstance(raw, dict) and raw.get("host")):
            # Unset: where this host's backends bind (BACKEND_HOST, default HOST), kept with
            # the config so a later change of the setting moves no running instance.
            config.host = self.settings.effective_backend_host
        self._check_config(raw, config, loc_prefix, warnings)
        return config

    def _check_config(
        self, raw: Any, config: Any, loc: tuple[str, ...], warnings: list[str] | None
    ) -> None:
        """Unknown fields (a near miss of a known one: 422; others warned, or 422 under
        STRICT_CONFIG) and fields the backend this host runs cannot honour (422): never
        silently dropped."""
        from solar_host.instances.config_fields import unknown_fields

        errors: list[dict[str, Any]] = []
        for key, msg, near_miss in unknown_fields(raw):
            if near_miss is not None or self.settings.strict_config:
                errors.append({"loc": [*loc, key], "msg": msg, "type": "extra_forbidden"})
            else:
                log.warning("config of %s: %s", config.alias, msg)
                if warnings is not None:
                    warnings.append(msg)
        try:
            backend = self.backends.for_type(config.backend_type)
        except KeyError:
            backend = None
        if backend is not None:
            # Accepted (the operator may install it before the start), but said at once.
            from solar_host.backends.availability import describe

            found = describe(backend, self.facts())
            if not found.available:
                msg = f"backend {config.backend_type} cannot run on this host: {found.reason}"
                log.warning("config of %s: %s", config.alias, msg)
                if warnings is not None:
                    warnings.append(msg)
        for r in backend.create_refusals(config, self.facts()) if backend is not None else ():
            errors.append({"loc": [*loc, r["field"]], "msg": r["msg"], "type": "unsupported"})
        if errors:
            raise InvalidInstanceConfig(errors)

    def _derived(self, config: Any) -> dict[str, Any]:
        backend = self.backends.for_type(config.backend_type)
        return {
            "supported_endpoints": backend.supported_endpoints(config),
            "served_model_name": backend.served_model_name(config),
            "capabilities": backend.capabilities(config, self.settings.models_dir),
        }
