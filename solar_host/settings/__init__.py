"""The host's settings: one object, read from the environment and `.env`, validated once.

Every tunable of the host is a field of `Settings` (schema.py; features add theirs there), so
the configuration reference is generated from it and cannot drift; loading.py reads it from
the environment and the env file.
"""

from solar_host.settings.loading import (
    SettingsError,
    load_settings,
    settings_warnings,
    unexpanded_paths,
)
from solar_host.settings.schema import PLACEHOLDER_API_KEYS, Settings, normalize_control_url

__all__ = [
    "PLACEHOLDER_API_KEYS",
    "Settings",
    "SettingsError",
    "load_settings",
    "normalize_control_url",
    "settings_warnings",
    "unexpanded_paths",
]
