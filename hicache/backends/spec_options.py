"""A backend spec's option values (from its query string, or keywords to `from_spec`) read as
numbers and yes/no flags, the same way for every backend. A bad value is a ValueError that
names the option and shows the value; nothing is clamped or guessed."""

from __future__ import annotations

YES = frozenset({"1", "true", "yes", "on"})
NO = frozenset({"0", "false", "no", "off", ""})


def number(
    value: object, what: str, *, lo: float, open_lo: bool = False, whole: bool = False
) -> float:
    """`value` as a finite number `>= lo` (`> lo` with `open_lo`), integral with `whole`.
    A bool is not a number. `what` names the option in the error ("nixl option threads")."""
    kind = "an integer" if whole else "a number"
    try:
        if isinstance(value, bool):
            raise ValueError
        x = float(value)  # type: ignore[arg-type]  # whatever float() takes, else ValueError
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be {kind}, got {value!r}") from None
    if x != x or x in (float("inf"), float("-inf")) or (whole and x != int(x)):
        raise ValueError(f"{what} must be {kind}, got {value!r}")
    if x < lo or (open_lo and x == lo):
        raise ValueError(f"{what} must be {kind} {'>' if open_lo else '>='} {lo:g}, got {value!r}")
    return x


def integer(value: object, what: str, *, lo: int) -> int:
    """`number(..., whole=True)` as an int."""
    return int(number(value, what, lo=lo, whole=True))


def flag(value: object, what: str, *, yes: frozenset[str] = YES, no: frozenset[str] = NO) -> bool:
    """`value` as yes or no: a bool, or one of the words in `yes` / `no` (any case)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in yes:
        return True
    if text in no:
        return False
    raise ValueError(f"{what} must be yes or no, got {value!r}")
