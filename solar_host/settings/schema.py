"""The host's settings as one validated object: every field, its default, its description
and its checks (the configuration reference in docs/ is generated from this file).

Nothing here touches the filesystem or reads `.env`: loading.py reads the environment and the
env file. `Settings(...)` built directly (tests, embedding) reads no environment at all.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from solar_host.platform.envfile import (
    api_key_problem,
)

# Keys that appeared in old READMEs and example files. A host started with one of them would
# be open to anyone who has read the docs, so start-up refuses them.
PLACEHOLDER_API_KEYS = frozenset(
    {
        "change-me-please",
        "your-secret-key-here",
        "your-api-key",
        "your-key",
        "changeme",
        "instance-key",
    }
)


class Settings(BaseModel):
    """Every setting of the host. The env var of a field is its name in upper case."""

    model_config = ConfigDict(extra="ignore", validate_default=True)

    # --- service -----------------------------------------------------------------------
    api_key: str = Field(
        default="",
        description="Key for the REST API (X-API-Key), the control link and the backends "
        "(Bearer): printable ASCII without spaces (it travels in HTTP headers). Empty: "
        "generated on first start and stored 0600 beside CONFIG_FILE.",
    )
    host: str = Field(default="0.0.0.0", description="Address the REST API binds to.")
    port: int = Field(default=8001, ge=1, le=65535, description="Port of the REST API.")
    backend_host: str | None = Field(
        default=None,
        description="Address backends bind to when an instance's config does not set `host` "
        "(default: HOST, so a host bound to 127.0.0.1 keeps its backends local too).",
    )
    http_header_timeout_s: float = Field(
        default=15.0,
        gt=0,
        le=3600,
        description="Seconds a client has to send a request's headers (from connecting, or "
        "from the first byte of the next request on a kept-alive connection) before the "
        "connection is closed. Without it, clients that never finish their headers (no key "
        "needed) could hold the host's descriptors until it accepts nothing.",
    )
    http_body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="Seconds a request's body has to arrive, from the request's start, before "
        "the request is answered 408. Without it, a body that stopped coming held its request "
        "(and what it held) for as long as the connection stayed open.",
    )
    config_file: Path = Field(
        default=Path("config.json"), description="Where instance records are kept."
    )
    log_dir: Path = Field(default=Path("logs"), description="Directory of backend log files.")
    log_format: Literal["text", "json"] = Field(
        default="text", description="Format of the host's own log: readable lines or JSON lines."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Level of the host's own log."
    )
    metrics_public: bool = Field(
        default=False, description="Serve GET /metrics without the API key."
    )
    max_request_body_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1024,
        description="Largest request body the REST API accepts (413 above it).",
    )

    # --- instances ---------------------------------------------------------------------
    start_port: int = Field(
        default=3500, ge=1, le=65535, description="First port handed to a backend."
    )
    max_retries: int = Field(
        default=2, ge=0, le=100, description="Extra attempts after a failed start attempt."
    )
    instance_ready_timeout_s: float = Field(
        default=600.0, gt=0, description="How long one start attempt may take to become ready."
    )
    fit_check: bool = Field(
        default=True,
        description="Refuse (409) a start whose memory estimate exceeds what its devices have "
        "free; a config's skip_fit_check: true also lets it through.",
    )
    start_deadline_s: float = Field(
        default=850.0,
        gt=0,
        description="All attempts of one start end within this (below control's 900 s timeout).",
    )
    stop_grace_s: float = Field(
        default=10.0, ge=0, description="Seconds between SIGTERM and SIGKILL when stopping."
    )
    restart_backoff_s: float = Field(
        default=1.0, ge=0, description="First delay before restarting a crashed backend."
    )
    restart_backoff_max_s: float = Field(
        default=60.0, ge=0, description="Cap of the doubling restart delay."
    )
    restart_max_in_window: int = Field(
        default=5, ge=1, description="Crashes within RESTART_WINDOW_S after which it stays failed."
    )
    restart_window_s: float = Field(
        default=600.0, gt=0, description="Window for counting crashes of one instance."
    )
    health_check_interval_s: float = Field(
        default=10.0,
        ge=0,
        description="Seconds between health probes of a running backend (0: none after it is "
        "ready).",
    )
    unhealthy_after_s: float = Field(
        default=120.0,
        gt=0,
        description="A running backend whose health endpoint has not answered for this long, "
        "using next to no CPU meanwhile, is ended and handled as a crash.",
    )
    canary_interval_s: float = Field(
        default=300.0,
        ge=0,
        description="Seconds between known-answer probes of an idle running backend (the first "
        "when it is ready; 0: none). A wrong answer is handled as a crash (canary_mismatch).",
    )
    canary_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A known-answer probe not answered within this many seconds is a failure "
        "(an engine that hangs while its health endpoint answers).",
    )
    boot_start_concurrency: int = Field(
        default=4, ge=1, description="How many instances are started at once at boot."
    )
    keep_backends_on_shutdown: bool = Field(
        default=False,
        description="Leave backends serving when the host shuts down (for upgrades); "
        "they are re-adopted on the next start.",
    )
    log_buffer_size: int = Field(
        default=1000, ge=1, description="Log lines kept in memory per instance."
    )
    retained_log_buffers: int = Field(
        default=20, ge=0, description="Log buffers of stopped instances kept in memory."
    )
    log_file_retention_s: float = Field(
        default=86400.0, ge=0, description="Age after which old backend log files are removed."
    )
    log_file_max_bytes: int = Field(
        default=100 * 1024 * 1024,
        ge=4096,
        description="Size at which a backend's or job step's log file is rotated "
        "(its content moves to <file>.1).",
    )
    log_file_generations: int = Field(
        default=3, ge=1, le=100, description="Rotated log files kept per log (<file>.1 ...)."
    )
    log_line_max_bytes: int = Field(
        default=16 * 1024,
        ge=256,
        le=16 * 1024 * 1024,
        description="Longest log line kept; the rest is cut, the line ends with a marker.",
    )
    start_failure_log_tail_lines: int = Field(
        default=20, ge=0, description="Lines in log_tail of a failed start."
    )
    backend_env_passthrough: str = Field(
        default="",
        description="Host environment variables passed to backends beyond the built-in "
        "allowlist (comma-separated names or patterns like MY_*). A credential-like name "
        "(*_KEY, *_TOKEN, *_PASSWORD, *_SECRET, HF_TOKEN, HARBOR_*) passes only when listed "
        "by its exact name.",
    )
    backend_read_confinement: Literal["auto", "required", "off"] = Field(
        default="auto",
        description="Kernel-enforced (Landlock) limit on what a backend may read: the model "
        "roots, the HF caches, its runtime and the system's libraries, never other files such "
        "as the host's state or /etc/shadow, whatever link leads there. auto: where the kernel "
        "has Landlock; required: a backend that cannot be confined does not start; off.",
    )
    backend_read_paths: str = Field(
        default="",
        description="More directories backends may read under BACKEND_READ_CONFINEMENT "
        "(comma-separated), for runtimes installed outside the usual places.",
    )
    backend_write_confinement: bool = Field(
        default=True,
        description="Where backends are confined (BACKEND_READ_CONFINEMENT), also limit what "
        "they may write to their caches (~/.cache, the HF caches, TMPDIR), /var/tmp and the "
        "devices runtimes use: never the host's state, its code, the model roots or other "
        "files.",
    )
    backend_write_paths: str = Field(
        default="",
        description="More directories confined backends may write (comma-separated), for "
        "caches kept outside the usual places (a hub cache that is a link to another disk: "
        "its target).",
    )
    llama_server_bin: str = Field(
        default="llama-server",
        description="llama-server executable (a path or a name on PATH). Unset and not on "
        "PATH: the llama.cpp server of the xllamacpp distribution (the llamacpp extra: "
        "pip install '.[llamacpp]' in the solar-host checkout).",
    )
    strict_config: bool = Field(
        default=False,
        description="Refuse (422) instance configs with a field no backend knows, instead of "
        "answering with a warning.",
    )

    # --- model store ---------------------------------------------------------------------
    models_dir: Path = Field(default=Path("models"), description="Managed models directory.")
    model_roots: str = Field(
        default="",
        description="More directories (comma-separated) instance configs may name files in, "
        "besides MODELS_DIR; every other path is refused (422).",
    )
    min_free_disk_gb: float = Field(
        default=2.0, ge=0, description="Free space floor for pulls and jobs."
    )
    pull_disk_poll_interval_s: float = Field(
        default=0.5, gt=0, description="How often a running pull checks free disk space."
    )
    pull_progress_interval_s: float = Field(
        default=5.0, gt=0, description="Throttle of `downloading` progress events."
    )
    harbor_url: str = Field(default="", description="Harbor (OCI registry) URL for repo:// pulls.")
    harbor_username: str = Field(default="", description="Harbor user.")
    harbor_password: str = Field(default="", description="Harbor password (never logged).")
    hf_token: str = Field(default="", description="HuggingFace Hub token (never logged).")
    hf_endpoint: str = Field(
        default="", description="HuggingFace Hub endpoint (empty: huggingface_hub's default)."
    )
    # Pulls: verified, resumable, polite (issue 42).
    pull_max_bytes_per_s: int = Field(
        default=0,
        ge=0,
        description="Cap on this host's download rate, all pulls together, in bytes per second "
        "(0: no cap). Answers 429/503 are waited out as their Retry-After asks either way.",
    )
    model_peers: str = Field(
        default="",
        description="Other solar-hosts (base URLs, comma-separated) a pull asks for each file, "
        "by its digest, before the source; needs PEER_TOKEN. Every byte is checked against "
        "the digest the source publishes.",
    )
    peer_token: str = Field(
        default="",
        description="Shared secret of the hosts that pull from each other: sent to MODEL_PEERS, "
        "and required (Authorization: Bearer) by this host's read-only /peer/v1 routes, which "
        "serve its checked model files. Empty: no peer is asked, and nothing is served to "
        "peers. Never the API key (ruling 26): a PEER_TOKEN equal to API_KEY serves nothing "
        "(never logged).",
    )
    peer_max_upload_bytes_per_s: int = Field(
        default=0,
        ge=0,
        description="Cap on what this host sends its peers (the /peer/v1 piece and file "
        "bodies), all of them together, in bytes per second (0: no cap).",
    )

    # --- control link ----------------------------------------------------------------------
    solar_control_url: str = Field(
        default="",
        description="solar-control URL(s), comma-separated for fail-over. Empty: standalone.",
    )
    solar_control_api_key: str = Field(
        default="", description="Ignored (kept for old .env files): the link uses API_KEY."
    )
    host_name: str = Field(
        default="", description="Name shown in solar-control (default: the machine's hostname)."
    )
    ws_reconnect_delay: float = Field(
        default=1.0, gt=0, description="First reconnect delay to solar-control (s)."
    )
    ws_reconnect_max_delay: float = Field(
        default=5.0, gt=0, description="Cap of the doubling reconnect delay (s)."
    )
    ws_ping_interval: float = Field(
        default=25.0,
        gt=0,
        description="Ignored (kept for old .env files): the link pings at the interval "
        "solar-control's server sets.",
    )
    insecure: bool = Field(
        default=False, description="Skip TLS verification towards solar-control."
    )
    health_report_interval_s: float = Field(
        default=10.0, gt=0, description="Period of host_health pushes."
    )
    outbox_max_entries: int = Field(
        default=10_000, ge=10, description="Bound of the queue of events for solar-control."
    )
    outbox_flush_interval_s: float = Field(
        default=0.1, gt=0, description="Batching period of log/state/step-log events."
    )
    control_report_min_interval_s: float = Field(
        default=0.1,
        gt=0,
        description="Least time between two instances_update (and two host_health) sends; "
        "changes in between are coalesced into the next full report (s).",
    )
    control_report_echo_s: str = Field(
        default="1,2,3,4,5",
        description="After a change, send the report again this many seconds after it "
        "(comma-separated), so one that lands in a quiet window at solar-control is repeated "
        "after it. Empty: no echoes.",
    )
    control_max_commands_in_flight: int = Field(
        default=64, ge=1, description="Socket commands run at once; more are answered 'busy'."
    )
    control_max_command_bytes: int = Field(
        default=1_048_576,
        ge=1024,
        description="Largest socket command payload (bytes); larger ones are answered "
        "'payload_too_large'.",
    )

    # --- jobs --------------------------------------------------------------------------------
    jobs_dir: Path = Field(default=Path("jobs"), description="Job workspaces root.")
    container_uid: int = Field(default=1000, ge=0, description="User id inside job containers.")
    container_gid: int = Field(default=1000, ge=0, description="Group id inside job containers.")
    hf_cache_dir: Path | None = Field(
        default=None,
        description="HF cache mounted into job containers (default: $HF_HOME or "
        "~/.cache/huggingface).",
    )
    job_inject_secrets: bool = Field(
        default=True, description="Give job steps HF_TOKEN and HARBOR_* (as control expects)."
    )
    job_network_mode: str = Field(
        default="bridge", description="Docker network mode of job containers."
    )
    job_pids_limit: int = Field(
        default=16384,
        ge=0,
        description="Most processes and threads one job container may hold (0: no limit); a "
        "fork bomb in a step then fails inside its container instead of exhausting the machine.",
    )
    job_memory_limit_gb: float | None = Field(
        default=None,
        gt=0,
        description="Most memory (GiB, swap included) one job container may use; past it the "
        "kernel kills the step's processes, not the host's. Unset: no limit (job processes are "
        "still the first the kernel kills when the machine runs out of memory).",
    )
    job_step_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="Most seconds one job step may run, from its container's start; past it "
        "the container is stopped (SIGTERM, then SIGKILL after 10 s) and the step fails, saying "
        "so. A step's own timeout_s may be shorter, never longer. Unset: steps without a "
        "timeout_s run until they end.",
    )
    job_cleanup_interval_s: float = Field(
        default=300.0, gt=0, description="Period of the finished-job retention sweep."
    )
    job_cancel_wait_s: float = Field(
        default=20.0, gt=0, description="How long DELETE /jobs/{id} waits for the job to end."
    )

    # --- resources ------------------------------------------------------------------------------
    default_reservation_ttl_seconds: float = Field(
        default=86400.0, gt=0, description="Expiry of a reservation that gives none."
    )
    resource_usage_interval_s: float = Field(
        default=10.0, gt=0, description="Period of the actual-usage refresh of reservations."
    )
    reservation_cleanup_interval_s: float = Field(
        default=60.0, gt=0, description="Period of the expired-reservation sweep."
    )

    # --- measured memory -------------------------------------------------------------------------
    measured_memory_margin: float = Field(
        default=0.05,
        ge=0.0,
        le=10.0,
        description="Share added to the measured peak of an earlier load of the same config "
        "when a start is admitted from it (0.05: 5 %). Configs never measured are admitted "
        "from the estimate.",
    )
    memory_sample_interval_s: float = Field(
        default=2.0,
        ge=0.1,
        le=3600.0,
        description="Period of the memory sampler: every running instance's process tree "
        "(RSS on the CPU, NVML per process on GPUs).",
    )
    memory_drift_share: float = Field(
        default=0.10,
        gt=0.0,
        le=10.0,
        description="A running instance above its admitted memory by more than this share "
        "(0.10: 10 %), and by 64 MiB at least, on a device for two samples in a row has "
        "drifted: an event, a log "
        "line and a metric, and the excess counts against the next start at once.",
    )
    memory_measurements_max: int = Field(
        default=500,
        ge=1,
        le=100_000,
        description="Configs whose measured memory is kept (memory-measurements.json); the "
        "least recently measured go first.",
    )

    # --- SGLang ----------------------------------------------------------------------------------
    sglang_venv_path: str = Field(
        default="", description="Virtualenv holding SGLang (bin/sglang or bin/python)."
    )
    sglang_prompt_cache_dir: str = Field(
        default="", description="Root of per-instance SGLang file prompt caches (dedicated)."
    )

    # What load_settings found odd in .env and the environment (logged when the host starts).
    _load_warnings: list[str] = PrivateAttr(default_factory=list)
    # The env file these settings were read from (absolute), when there was one.
    _env_file: Path | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _choices_any_case(cls, data: object) -> object:
        """Settings with a fixed set of choices accept any case (LOG_LEVEL=INFO)."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name in _choice_fields():
            value = out.get(name)
            if isinstance(value, str):
                out[name] = value.strip().lower()
        return out

    @property
    def load_warnings(self) -> list[str]:
        return list(self._load_warnings)

    @field_validator("api_key", "host_name", "solar_control_url", "harbor_url", mode="before")
    @classmethod
    def _strip(cls, v: object) -> object:
        return v.strip() if isinstance(v, str) else v

    @field_validator("solar_control_url")
    @classmethod
    def _check_control_urls(cls, v: str) -> str:
        # Here, not when the link starts: a bad URL was a traceback at start-up, or (a port out
        # of range) a link failing for ever.
        for item in _items(v):
            normalize_control_url(item)
        return v

    @field_validator("host")
    @classmethod
    def _refuse_url_host(cls, v: str) -> str:
        # HOST=http://... (a client's URL variable, as old examples named it) is no address.
        if "://" in v or "/" in v:
            raise ValueError(
                f"{v!r} is a URL or a path, not an address to bind (such as 0.0.0.0 or "
                "127.0.0.1); the command line takes a host's URL from SOLAR_HOST_URL or --url"
            )
        return v

    @field_validator("control_report_echo_s")
    @classmethod
    def _check_echo(cls, v: str) -> str:
        _echo_delays(v)
        return v

    @field_validator("api_key")
    @classmethod
    def _refuse_placeholder(cls, v: str) -> str:
        if v and v.lower() in PLACEHOLDER_API_KEYS:
            raise ValueError(
                "is a placeholder from the documentation; set a secret of your own "
                "or leave API_KEY empty to have one generated"
            )
        # A key no HTTP client can put in a header would lock every client out.
        problem = api_key_problem(v) if v else None
        if problem is not None:
            raise ValueError(problem)
        return v

    # --- derived values -----------------------------------------------------------------------
    @property
    def effective_backend_host(self) -> str:
        return self.backend_host or self.host

    @property
    def effective_host_name(self) -> str:
        return self.host_name or socket.gethostname()

    @property
    def control_urls(self) -> list[str]:
        return _items(self.solar_control_url)

    @property
    def model_root_dirs(self) -> list[Path]:
        """MODELS_DIR first (relative paths resolve against it), then MODEL_ROOTS."""
        extra = [Path(p).expanduser() for p in _items(self.model_roots)]
        return [self.models_dir, *extra]

    @property
    def backend_extra_read_dirs(self) -> list[str]:
        """BACKEND_READ_PATHS: trees backends may read beyond the model roots and runtime."""
        return _items(self.backend_read_paths)

    @property
    def backend_extra_write_dirs(self) -> list[str]:
        """BACKEND_WRITE_PATHS: trees backends may write beyond their caches."""
        return _items(self.backend_write_paths)

    @property
    def control_echo_delays(self) -> list[float]:
        return _echo_delays(self.control_report_echo_s)

    @property
    def api_key_file(self) -> Path:
        """Where a generated key is kept: beside config.json."""
        return self.config_file.parent / "api_key"

    @property
    def env_file(self) -> Path | None:
        """The env file these settings were read from, if any (the host's, never a backend's)."""
        return self._env_file

    @property
    def reservations_file(self) -> Path:
        """The reservation ledger's file: beside config.json."""
        return self.config_file.parent / "reservations.json"

    @property
    def memory_measurements_file(self) -> Path:
        """What earlier loads took per config: beside config.json."""
        return self.config_file.parent / "memory-measurements.json"


def _items(text: str) -> list[str]:
    """The non-blank items of a comma-separated setting, stripped."""
    return [item.strip() for item in text.split(",") if item.strip()]


def normalize_control_url(url: str) -> str:
    """scheme://host[:port] of one SOLAR_CONTROL_URL item: ws->http, wss->https, bare->http;
    the path (e.g. the legacy /ws/host-channel) is dropped: control serves /socket.io/ only.
    Raises ValueError saying what is wrong."""
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urlsplit(text)
    except ValueError as err:  # an unclosed IPv6 bracket: "Invalid IPv6 URL" alone names nothing
        raise ValueError(f"{err} in {_without_password(url)!r}") from None
    # What the error quotes: the item as written, less any password in it.
    shown = repr(url.strip().replace(f"{parts.username}:{parts.password}@", "***@"))
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme.lower(), parts.scheme.lower())
    if scheme not in ("http", "https"):
        raise ValueError(
            f"unsupported scheme {parts.scheme!r} in {shown} (use http, https, ws or wss)"
        )
    if not parts.hostname:
        raise ValueError(f"no host in {shown}")
    try:
        port = parts.port
    except ValueError:  # not a number, or past 65535
        port = 0
    if port == 0:
        raise ValueError(f"the port in {shown} is not a number from 1 to 65535")
    return f"{scheme}://{parts.netloc}"


def _without_password(url: str) -> str:
    """`url` with whatever sits between "://" and the last "@" of its authority shown as ***:
    for a URL urlsplit cannot take apart."""
    text = url.strip()
    scheme, sep, rest = text.rpartition("://")
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "***@" + authority.rpartition("@")[2]
    return f"{scheme}{sep}{authority}{slash}{path}"


def _echo_delays(text: str) -> list[float]:
    """ "1,2,4" -> [1.0, 2.0, 4.0]; each a positive number of seconds, at most 60."""
    delays = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"not a number of seconds: {part.strip()!r}") from None
        if not 0 < value <= 60:
            raise ValueError(f"each delay must be above 0 and at most 60 s, not {value}")
        delays.append(value)
    return sorted(delays)


def _choice_fields() -> list[str]:
    """Fields whose type is a Literal of lower-case strings (matched case-insensitively)."""
    import typing

    out = []
    for name, field in Settings.model_fields.items():
        ann = field.annotation
        if typing.get_origin(ann) is Literal and all(
            isinstance(a, str) and a == a.lower() for a in typing.get_args(ann)
        ):
            out.append(name)
    return out
