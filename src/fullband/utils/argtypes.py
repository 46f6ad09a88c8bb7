"""The argparse types of every numeric command-line option, each with its range.

Owns :class:`Number` and the shared instances (:data:`POSITIVE_INT`, :data:`NONNEG_INT`, :data:`POSITIVE_FLOAT`,
:data:`NONNEG_FLOAT`, :data:`FRACTION`, :data:`OPEN_FRACTION`, :data:`POSITIVE_FRACTION`, :data:`PROBABILITY`,
:func:`int_at_least`, :func:`int_range`). Every command's ``int`` / ``float`` option takes one of them
(``tests/test_cli_numbers.py`` walks the whole parser and refuses a bare ``int`` or ``float``), so a value out of
range is argparse's one-line error naming the option (``fullband X: error: argument --batch-size: must be an
integer >= 1, got '0'``), exit 2, before anything runs. A type's :attr:`Number.bad` is a value it refuses (what
that test passes).
"""

from __future__ import annotations

import argparse
import math


class Number:
    """An argparse ``type``: ``int`` or ``float`` text within ``[lo, hi]`` (either end open, or ``None``: none)."""

    def __init__(self, kind: type, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
                 hi_open: bool = False):
        self.kind, self.lo, self.hi, self.lo_open, self.hi_open = kind, lo, hi, lo_open, hi_open
        self.__name__ = kind.__name__  # what argparse names the type by

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a number"
        if self.lo is not None and self.hi is not None:
            return f"{what} in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{what} {'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is not None:
            return f"{what} {'<' if self.hi_open else '<='} {self.hi:g}"
        return what

    def ok(self, value) -> bool:
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def __call__(self, text: str):
        try:
            value = self.kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text!r}") from None
        if (self.kind is float and not math.isfinite(value)) or not self.ok(value):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text!r}")
        return value

    @property
    def bad(self) -> str:
        """A value this type refuses: just past an end of its range (or not a finite number)."""
        if self.lo is not None:
            return str(self.kind(self.lo) if self.lo_open else self.kind(self.lo) - 1)
        if self.hi is not None:
            return str(self.kind(self.hi) if self.hi_open else self.kind(self.hi) + 1)
        return "nan"

    def __repr__(self) -> str:
        return f"Number({self.describe()})"


def int_at_least(lo: int) -> Number:
    return Number(int, lo)


def int_range(lo: int, hi: int) -> Number:
    return Number(int, lo, hi)


POSITIVE_INT = Number(int, 1)
NONNEG_INT = Number(int, 0)
POSITIVE_FLOAT = Number(float, 0, lo_open=True)
NONNEG_FLOAT = Number(float, 0)
FRACTION = Number(float, 0, 1)  # [0, 1]
OPEN_FRACTION = Number(float, 0, 1, hi_open=True)  # [0, 1)
POSITIVE_FRACTION = Number(float, 0, 1, lo_open=True)  # (0, 1]: a nucleus mass, a utilisation
PROBABILITY = Number(float, 0, 1, lo_open=True, hi_open=True)  # (0, 1): a confidence level
