"""Cross-cutting runtime pieces: settings, logging, metrics, back-off, health, CLI."""
