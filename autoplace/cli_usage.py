"""The command line's own usage errors as one line, like every other error.

Typer parses the command line with click, whose usage errors -- an unknown option, a missing
argument, a value outside an option's range or choices -- print a usage line, a hint and a
boxed message over five or six lines.  :class:`OneLineUsage`, the app's command group, turns
each into the line every autoplace error is (``autoplace: error: --method: 'Full' is not one of
'full', 'lora', 'qlora'``) and exit code 2.  Help asked for (``--help``, or no arguments at all)
is still printed in full.

:func:`finite` is the check every float option adds to its range: click's ``min``/``max`` let
``inf`` through (and ``nan`` where no bound is set), which no option here means.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from typer.core import TyperGroup

# click's exceptions, from the package typer's own BadParameter comes from: click itself, or the
# copy of click typer vendors since 0.2x (typer._click)
_CLICK = sys.modules[typer.BadParameter.__module__]
UsageError: type[Exception] = _CLICK.UsageError
_HELP_ASKED = tuple(c for c in (getattr(_CLICK, "NoArgsIsHelpError", None),) if c is not None)


def finite(value: float | None) -> float | None:
    """A float option's value, refused (click's usage error) when it is not a finite number."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"expected a finite number, got {value}")
    return value


class OneLineUsage(TyperGroup):
    """The app's group: click's usage errors, on the group or any command, become one stderr
    line naming the option or argument, and exit code 2."""

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        with _one_line():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: Any) -> Any:
        with _one_line():  # the command's name is resolved and its options parsed here
            return super().invoke(ctx)


@contextmanager
def _one_line() -> Iterator[None]:
    try:
        yield
    except _HELP_ASKED:
        raise
    except UsageError as exc:
        from autoplace.specs._io import one_line

        typer.echo(f"autoplace: error: {one_line(usage_message(exc))}", err=True)
        raise typer.Exit(2) from None


def usage_message(exc: Exception) -> str:
    """``NAME: what is wrong`` for a click usage error: the option (its long form) or argument,
    then the reason, in the words of the check that failed."""
    param = getattr(exc, "param", None)
    option = getattr(exc, "option_name", None)
    reason = _reason(exc)
    if param is not None:
        return f"{_name(param)}: {reason}"
    if option:
        return f"{option}: {reason}"
    return reason


def _name(param: Any) -> str:
    """An option's first long spelling, the name its help gives (``--days`` of ``--days/--max-days``,
    ``--verbose`` of ``-v/--verbose``), an argument's metavar (``MODEL``)."""
    opts = [o for o in getattr(param, "opts", []) if o.startswith("-")]
    if opts:
        return next((o for o in opts if o.startswith("--")), opts[0])
    return str(getattr(param, "metavar", None) or param.name).upper()


def _reason(exc: Exception) -> str:
    """The check's own words: the validation error typer raised from (its bound and the value
    given), else click's message without the name it repeats."""
    kind = type(exc).__name__
    if kind == "MissingParameter":
        return "required; none given"
    if kind == "NoSuchOption":
        close = sorted(getattr(exc, "possibilities", None) or [])
        return "no such option" + (f" (did you mean {' or '.join(close)}?)" if close else "")
    cause = exc.__cause__
    errors = cause.errors() if cause is not None and hasattr(cause, "errors") else []
    if errors:
        return _validation_reason(errors[0])
    message = str(getattr(exc, "message", exc)).strip().rstrip(".")
    option = getattr(exc, "option_name", None)
    if option:  # "Option '--json' does not take a value" -> "does not take a value"
        message = message.replace(f"Option '{option}' ", "")
    return message[:1].lower() + message[1:]


# pydantic's error types (typer >= 0.2x validates option values with pydantic) and their bound
_BOUNDS = {"greater_than_equal": (">=", "ge"), "less_than_equal": ("<=", "le"), "greater_than": (">", "gt"),
           "less_than": ("<", "lt")}
_PARSING = {"int_parsing": "a whole number", "int_from_float": "a whole number", "float_parsing": "a number",
            "bool_parsing": "true or false"}


def _validation_reason(error: dict[str, Any]) -> str:
    kind, given, ctx = error.get("type"), error.get("input"), error.get("ctx") or {}
    if kind in _BOUNDS:
        sign, key = _BOUNDS[kind]
        return f"must be {sign} {ctx.get(key)}, got {given}"
    if kind in _PARSING:
        return f"expected {_PARSING[kind]}, got {given!r}"
    if kind == "value_error" and "error" in ctx:  # a choice: "'Full' is not one of 'full', 'lora', 'qlora'."
        return str(ctx["error"]).rstrip(".")
    return str(error.get("msg", "invalid value")).rstrip(".")
