"""The host's own log: readable lines by default, JSON lines with LOG_FORMAT=json.

Every line is redacted before it is written: credentials in query strings (`?api_key=...`,
which uvicorn prints in its access and WebSocket lines), Bearer and X-API-Key values, and the
literal values of the host's secrets (API_KEY, HF_TOKEN, HARBOR_PASSWORD) wherever they appear.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
from collections.abc import Iterable
from datetime import UTC, datetime

from solar_host.settings import Settings

# Set by the request-id middleware and by supervisors, so every line says what it is about.
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "request_id", default=None
)
instance_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "instance_id", default=None
)


REDACTED = "***"
# `name=value` in a query string (or a form body) whose name says it is a credential.
_QUERY_SECRET = re.compile(
    r"(?i)((?:^|[?&;\s\"'])(?:[a-z0-9_.-]*(?:api[_-]?key|apikey|token|password|passwd|secret)"
    r"|key|auth|sig|signature)=)[^&;\s\"'#]+"
)
_BEARER = re.compile(r"(?i)(\b(?:bearer|basic)\s+)[A-Za-z0-9._~+/=:-]+")
_URL_PASSWORD = re.compile(r"(://[^/\s:@]+:)[^/\s@]+@")
_KEY_HEADER = re.compile(r"(?i)(x-api-key[\"']?\s*[:=]\s*[\"']?)[^\s\"',;}]+")


class Redactor:
    """Removes credentials from text: known secret values and credential-shaped fields."""

    def __init__(self, secrets: Iterable[str] = (), *, shapes: bool = True):
        self._secrets: tuple[str, ...] = ()
        # shapes=False: the known values only. Backend lines (many with `=`) are followed at
        # up to 10^5 a second, and the field patterns cost ~9 us a line there, half again
        # what the rest of the host spends on one.
        self.shapes = shapes
        self.add(secrets)

    def add(self, secrets: Iterable[str]) -> None:
        # Short values would blank ordinary words; real keys and tokens are long.
        new = {s for s in secrets if s and len(s) >= 6}
        self._secrets = tuple(sorted(set(self._secrets) | new, key=len, reverse=True))

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        if not self.shapes:
            return text
        if "=" in text:
            text = _QUERY_SECRET.sub(lambda m: m.group(1) + REDACTED, text)
        if "earer" in text or "asic" in text or "BEARER" in text:
            text = _BEARER.sub(lambda m: m.group(1) + REDACTED, text)
        if "://" in text and "@" in text:
            text = _URL_PASSWORD.sub(lambda m: m.group(1) + REDACTED + "@", text)
        if "api-key" in text.lower():
            text = _KEY_HEADER.sub(lambda m: m.group(1) + REDACTED, text)
        return text


# The redactor of the configured handler; secrets learnt later (a generated key) are added.
redact = Redactor()


def add_secrets(*secrets: str) -> None:
    redact.add(secrets)


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        if not hasattr(record, "instance_id"):
            record.instance_id = instance_id_var.get()
        return True


# C0 controls but tab, DEL and C1 controls: a newline in a message would start a forged line, an
# escape sequence would rewrite the operator's terminal. Messages carry what callers send
# (config field names, ids, URIs).
_CONTROLS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    if not _CONTROLS.search(text):
        return text
    return _CONTROLS.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        ctx = ""
        if getattr(record, "instance_id", None):
            ctx += f" instance={record.instance_id}"
        if getattr(record, "request_id", None):
            ctx += f" request={record.request_id}"
        message = escape_controls(record.getMessage())
        line = f"{ts} {record.levelname:<7} {record.name}{ctx}: {message}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return redact(line)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in ("instance_id", "request_id"):
            value = getattr(record, key, None)
            if value:
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return redact(json.dumps(doc, ensure_ascii=False))


def configure_logging(settings: Settings) -> None:
    add_secrets(settings.api_key, settings.hf_token, settings.harbor_password)
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if settings.log_format == "json" else TextFormatter())
    handler.addFilter(_ContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
