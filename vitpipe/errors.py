"""User-facing errors.

A ``ConfigError`` is a mistake in what the user asked for (a config value, a path, a
checkpoint). ``scripts/*.py`` print it as one line and exit with status 2: no traceback
wall for a config mistake.
"""


class ConfigError(ValueError):
    """A bad config value or input; the message names the value and what would be valid."""


class ExportCheckError(RuntimeError):
    """An exported model (timm folder, ONNX file) does not compute what the checkpoint's network computes."""
