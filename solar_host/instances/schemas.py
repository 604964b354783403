"""Instance records, the config union of all backends, and config parsing rules."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from solar_host.backends.huggingface_config import (
    HuggingFaceCausalConfig,
    HuggingFaceClassificationConfig,
    HuggingFaceEmbeddingConfig,
    HuggingFaceVisionConfig,
)
from solar_host.backends.llamacpp_config import LlamaCppConfig
from solar_host.backends.sglang_config import SglangConfig
from solar_host.instances.states import InstanceStatus
from solar_host.model_store import roots as model_roots
from solar_host.model_store.sources import (
    SourceError,
    is_remote_source,
    pull_hint,
    pulled_path,
    resolve_local_uri,
    resolve_model_path,
)
from solar_host.platform.textsafe import CONTROL_CHARS_RE, NOT_FINITE, NOT_UNICODE, unstorable
from solar_host.platform.tracked import Tracked

InstanceConfig = Annotated[
    LlamaCppConfig
    | HuggingFaceCausalConfig
    | HuggingFaceClassificationConfig
    | HuggingFaceEmbeddingConfig
    | HuggingFaceVisionConfig
    | SglangConfig,
    Field(discriminator="backend_type"),
]
_config_adapter: TypeAdapter[Any] = TypeAdapter(InstanceConfig)

BACKEND_TYPES = (
    "llamacpp",
    "huggingface_causal",
    "huggingface_classification",
    "huggingface_embedding",
    "huggingface_vision",
    "sglang",
)


def config_models() -> dict[str, type[BaseModel]]:
    """The config class of every backend_type."""
    import typing

    classes = (
        LlamaCppConfig,
        HuggingFaceCausalConfig,
        HuggingFaceClassificationConfig,
        HuggingFaceEmbeddingConfig,
        HuggingFaceVisionConfig,
        SglangConfig,
    )
    out: dict[str, type[BaseModel]] = {}
    for cls in classes:
        for bt in typing.get_args(cls.model_fields["backend_type"].annotation):
            out[bt] = cls
    return out


# The config field that holds the model path, per backend family.
MODEL_FIELD = {
    "llamacpp": "model",
    "sglang": "model_path",
}


def model_field_of(backend_type: str) -> str:
    return MODEL_FIELD.get(backend_type, "model_id")


class Priority(StrEnum):
    PRODUCTION = "production"
    STAGING = "staging"
    EPHEMERAL = "ephemeral"


class Instance(Tracked):  # Tracked: config.json re-encodes only changed records
    """An instance record as the REST API shows it (control-contract 3.2)."""

    model_config = ConfigDict(protected_namespaces=())

    id: str
    config: InstanceConfig
    status: InstanceStatus = InstanceStatus.STOPPED
    port: int | None = None
    pid: int | None = None
    created_at: datetime
    started_at: datetime | None = None
    error_message: str | None = None
    retry_count: int = 0
    priority: Priority = Priority.PRODUCTION
    managed_by: str | None = None
    intent_id: str | None = None
    supported_endpoints: list[str] = Field(default_factory=list)
    served_model_name: str | None = None
    capabilities: list[str] | None = None
    placed_devices: list[str] | None = Field(
        default=None,
        description="Devices of the last start (cpu, cuda:N): the host's or the config's choice.",
    )


class InstanceCreate(BaseModel):
    config: dict[str, Any] = Field(description="Backend config, discriminated by backend_type.")
    priority: Priority | None = None
    managed_by: str | None = Field(default=None, max_length=64)
    intent_id: str | None = Field(default=None, max_length=256)


class InstanceUpdate(BaseModel):
    """Only fields present in the body change; an explicit null clears managed_by/intent_id."""

    config: dict[str, Any] | None = None
    managed_by: str | None = Field(default=None, max_length=64)
    intent_id: str | None = Field(default=None, max_length=256)


class InstanceResponse(BaseModel):
    instance: Instance
    message: str
    warnings: list[str] | None = Field(
        default=None, description="Config fields no backend knows (kept, but check them)."
    )


class ConfigError(ValueError):
    """A config failed validation. `errors` are pydantic-style dicts with a `loc` path."""

    def __init__(self, errors: list[dict[str, Any]]):
        self.errors = errors
        super().__init__("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors))


def _error(loc: tuple[Any, ...], msg: str, typ: str = "value_error") -> ConfigError:
    return ConfigError([{"loc": loc, "msg": msg, "type": typ}])


def migrate_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Infer `backend_type` for configs written before it existed (reference 1.2)."""
    if raw.get("backend_type") not in (None, ""):
        return raw
    out = dict(raw)
    if raw.get("model"):
        out["backend_type"] = "llamacpp"
    elif raw.get("model_id") and raw.get("labels"):
        out["backend_type"] = "huggingface_classification"
    elif raw.get("model_id"):
        out["backend_type"] = "huggingface_causal"
    else:
        out["backend_type"] = "llamacpp"
    return out


def _pydantic_errors(err: ValidationError) -> list[dict[str, Any]]:
    out = []
    for e in err.errors(include_url=False, include_context=False, include_input=False):
        loc = list(e["loc"])
        # The discriminated union puts the backend tag first in the path; drop it.
        if loc and loc[0] in BACKEND_TYPES:
            loc = loc[1:]
        msg = e["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        out.append({"loc": tuple(loc), "msg": msg, "type": e["type"]})
    return out


# Resolves llama.cpp file patterns (model_file, mmproj, spec_draft_model) against a base dir.
FileResolver = Callable[[Any, "Path | None", bool], Any]
# Maps a remote model_source (repo://, huggingface://) to the directory a pull left it in.
ManifestLookup = Callable[[str], "Path | None"]


def parse_config(
    raw: Any,
    *,
    models_dir: Path,
    strict: bool = True,
    manifest_lookup: ManifestLookup | None = None,
    roots: Sequence[Path] | None = None,
) -> Any:
    """Validate a config dict into a typed backend config, resolving model paths.

    `strict=False` is for loading config.json: a recorded model file that no longer resolves
    is kept as recorded (a missing file shows when the instance starts), never dropped.
    Every path the final config names must lie inside one of `roots` (MODELS_DIR first, then
    MODEL_ROOTS; default: MODELS_DIR alone), see model_store/roots.py. A record loaded with
    `strict=False` is not refused for that: its start checks again and fails with the reason.
    Raises ConfigError with field paths.
    """
    if roots is None:
        roots = [models_dir]
    check_roots = strict
    if not isinstance(raw, dict):
        raise _error((), "config must be a JSON object", "dict_type")
    bad = unstorable(raw)
    if bad is not None:
        # A lone surrogate (JSON "\\ud800") or nesting past MAX_DEPTH would be kept in memory
        # and then fail every write of config.json and every answer that echoes the config.
        loc, why = bad
        kind = {NOT_UNICODE: "string_unicode", NOT_FINITE: "finite_number"}.get(why, "too_deep")
        raise _error(loc, why, kind)
    raw = migrate_config(raw)
    bt = raw.get("backend_type")
    if bt not in BACKEND_TYPES:
        raise _error(
            ("backend_type",),
            f"Unknown backend_type: {bt!r}; expected one of {', '.join(BACKEND_TYPES)}",
            "literal_error",
        )
    try:
        config = _config_adapter.validate_python(raw)
    except ValidationError as err:
        raise ConfigError(_pydantic_errors(err)) from None

    field = model_field_of(bt)
    current = getattr(config, field, None)
    source = config.model_source
    try:
        if current:
            resolved = resolve_model_path(
                current, models_dir, hub_id_allowed=bt.startswith("huggingface")
            )
            setattr(config, field, resolved)
        elif source:
            if is_remote_source(source):
                # By name: the model a previous pull put in the store (its manifest knows the
                # source_uri); never pulled, the error says which pull to run.
                found = pulled_path(source, manifest_lookup)
                if found is None:
                    raise SourceError(pull_hint(source))
                setattr(config, field, str(found))
            elif source.startswith("local://"):
                setattr(config, field, str(resolve_local_uri(source, models_dir)))
            else:
                setattr(config, field, resolve_model_path(source, models_dir))
    except SourceError as err:
        loc = (field,) if current else ("model_source",)
        raise _error(loc, str(err)) from None

    if strict and CONTROL_CHARS_RE.search(config.alias):
        # Where it is given, not at load: a record kept by an older release loads as it is.
        raise _error(("alias",), "alias must not contain control characters")
    if check_roots:
        # Before patterns are globbed, so no directory outside the roots is even listed.
        _check_roots(config, roots)
    if bt == "llamacpp":
        from solar_host.backends import files

        base_dir = _llamacpp_base_dir(config, manifest_lookup)
        try:
            config = files.resolve_config_files(config, base_dir, strict, models_dir)
            if config.model and Path(config.model).is_dir():
                # A directory holding exactly one GGUF model means that file.
                config.model = str(files.gguf_of_dir(Path(config.model)))
        except files.PatternError as err:
            if strict:
                raise _error((err.field,), str(err)) from None
    if check_roots:
        _check_roots(config, roots)
    return config


def _check_roots(config: Any, roots: Sequence[Path]) -> None:
    try:
        model_roots.check_config(config, roots)
    except model_roots.OutsideRoots as err:
        raise _error(tuple(err.field.split(".", 1)), str(err)) from None


def _llamacpp_base_dir(config: LlamaCppConfig, lookup: ManifestLookup | None) -> Path | None:
    source = config.model_source
    if source and is_remote_source(source) and lookup is not None:
        found = lookup(source)
        if found is not None:
            return found
    if config.model:
        p = Path(config.model)
        try:
            return p if p.is_dir() else p.parent
        except OSError:  # e.g. a stored record's name too long to stat: its start says why
            return p.parent
    return None


def config_to_dict(config: Any) -> dict[str, Any]:
    """The config as stored and echoed: every field, unknown keys included, JSON types."""
    return config.model_dump(mode="json")
