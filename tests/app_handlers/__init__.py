"""Handler-level tests of the app, one module per feature (``app/handlers/``)."""
