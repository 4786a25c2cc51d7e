"""The settings by section, each a frozen dataclass extending the one before it (so the
fields keep one order: the settings table's)."""
