"""Errors raised by ``medusa_core`` that callers are expected to show to a user as they are."""


class MedusaCheckpointError(ValueError):
    """A checkpoint or backbone that cannot be loaded; the message names the file, what was expected
    and what was found."""
