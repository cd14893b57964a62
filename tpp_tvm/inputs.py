"""A model call's arguments bound to its input names (positional first, then by name), with
errors that name the inputs: shared by static and dynamic compiled models."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import UnsupportedShapeError


def bind_inputs(names: Sequence[str], args: tuple, kwargs: dict[str, Any]) -> list[Any]:
    """The values of ``names`` in order, from ``args`` and then ``kwargs``."""
    listed = ", ".join(names)
    unknown = [k for k in kwargs if k not in names]
    if unknown:
        raise UnsupportedShapeError(f"unknown inputs: {', '.join(unknown)} (inputs: {listed})")
    if len(args) + len(kwargs) != len(names):
        raise UnsupportedShapeError(
            f"model takes {len(names)} inputs ({listed}), got {len(args) + len(kwargs)}")
    kwargs = dict(kwargs)
    values = list(args)
    for name in names[len(args):]:
        if name not in kwargs:
            raise UnsupportedShapeError(f"missing input {name!r}")
        values.append(kwargs.pop(name))
    if kwargs:  # named inputs also given by position
        raise UnsupportedShapeError(f"unknown inputs: {', '.join(kwargs)}")
    return values
