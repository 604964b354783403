"""`uvicorn solar_host.main:app`: the one module that builds an app from the environment at
import (ruling 8). Everything else builds hosts explicitly with `create_app(settings)`.

It is the same staged app as `solar-host serve` (serving.py): /health and GET /instances answer
as soon as the lifespan has run, the router follows within a second."""

from __future__ import annotations

import os
import sys

# Before the first pydantic model is built (settings): see cli.command.skip_pydantic_plugins.
os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")

from solar_host.platform.logging_setup import configure_logging
from solar_host.serving import staged_app
from solar_host.settings import SettingsError, load_settings

try:
    settings = load_settings()
except SettingsError as _err:
    print(f"solar-host: {_err}", file=sys.stderr)
    raise SystemExit(2) from None

configure_logging(settings)
app = staged_app(settings)
