"""memproxy's settings: one typed, frozen object read once at start-up."""

from config.flags import Flags
from config.routing import ApiKey, Route
from config.settings import Settings, SettingsError, env_name, load_settings, setting_fields

__all__ = [
    "ApiKey",
    "Flags",
    "Route",
    "Settings",
    "SettingsError",
    "env_name",
    "load_settings",
    "setting_fields",
]
