"""`uvicorn solar_host.main:app`: the one module that builds an app from the environment at
import (ruling 8). Everything else builds hosts explicitly with `create_app(settings)`."""

from __future__ import annotations

import sys

from solar_host.app import create_app
from solar_host.logging_setup import configure_logging
from solar_host.settings import SettingsError, load_settings

try:
    settings = load_settings()
except SettingsError as _err:
    print(f"solar-host: {_err}", file=sys.stderr)
    raise SystemExit(2) from None

configure_logging(settings)
app = create_app(settings)
