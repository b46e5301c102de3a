"""User-facing errors, and the one-line argument checks that raise them.

A ``ConfigError`` is a mistake in what the user asked for (a config value, a path, a
checkpoint). ``scripts/*.py`` print it as one line and exit with status 2: no traceback
wall for a config mistake.
"""


class ConfigError(ValueError):
    """A bad config value or input; the message names the value and what would be valid."""


class ExportCheckError(RuntimeError):
    """An exported model (timm folder, ONNX file) does not compute what the checkpoint's network computes."""


def check_int(value, name: str, minimum: int = 1) -> int:
    """An int (not a bool) >= minimum, else ConfigError."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}={value!r}: expected an int >= {minimum}")
    return value


def to_hw(value, name: str) -> tuple[int, int]:
    """An int or a [h, w] pair (a list, tuple or OmegaConf ListConfig) -> (h, w), both positive."""
    try:
        pair = (value, value) if isinstance(value, int) else tuple(value)  # a bool fails the test below
    except TypeError:
        pair = ()
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair):
        raise ConfigError(f"{name}={value!r}: expected a positive int or a [height, width] pair of positive ints")
    return pair
