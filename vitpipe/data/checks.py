"""Argument checks shared by the data modules: each raises a one-line ConfigError naming the key."""

from vitpipe.errors import ConfigError


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
