"""Management: sessions, stats, backup, export and import, clear-all, forgetting."""
