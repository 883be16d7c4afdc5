"""One small typed loader for frozen config dataclasses: a TOML file plus --key=value overrides.

Values are converted to the field's declared type (int, float, bool, str, optional, tuple of
str); unknown keys and unparsable values raise ConfigError with one line. Nothing is exec'd.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from teragram.index.errors import TeragramError

T = TypeVar("T")


class ConfigError(TeragramError):
    pass


def _convert(name: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return _convert(name, args[0], value)
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else list(value)
        return tuple(str(x).strip() for x in items if str(x).strip())
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: expected true/false, got {value!r}")
    if tp in (int, float, str):
        try:
            if tp is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return tp(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected {tp.__name__}, got {value!r}") from None
    return value


def load(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None, **defaults: Any) -> T:
    """Build cls from a TOML file (optional) and ["key=value", "--key=value", ...] overrides."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = dict(defaults)
    if path is not None:
        try:
            with open(path, "rb") as f:
                values.update(tomllib.load(f))
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: {e}") from None
    for o in overrides or []:
        key, sep, val = o.lstrip("-").partition("=")
        if not sep:
            raise ConfigError(f"override {o!r} is not key=value")
        values[key.replace("-", "_")] = val
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(unknown)}")
    return cls(**{k: _convert(k, hints[k], v) for k, v in values.items()})
