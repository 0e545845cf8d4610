"""A backend spec's options (from its query string, or keywords to `from_spec`): directory specs
split and merged, values read as numbers and yes/no flags, the same way for every backend. A
bad name or value is an error that names it; nothing is clamped or guessed."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

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


@dataclass(frozen=True, slots=True)
class DirSpec:
    """A `SCHEME:DIR[?name=value&...]` spec split (`split_dir_spec`)."""

    root: str
    values: dict[str, Any]  # the query's options, then the keywords over them
    passed: dict[str, str]  # `PREFIX.name=value` options, for a library of the backend's own


def split_dir_spec(
    spec: object,
    scheme: str,
    *,
    known: Collection[str],
    options: Mapping[str, Any],
    example: str,
    passthrough: str | None = None,
    keyword_only: Collection[str] = (),
) -> DirSpec:
    """Split a directory spec and merge its keyword `options` over the query's. Names outside
    `known` are a ValueError (in the query: it names the spec) or a TypeError (a keyword;
    `keyword_only` names are allowed there too); query names starting with `passthrough` are
    kept apart, without it. A spec without the scheme or the directory is a ValueError;
    `example` shows a right one."""
    if not isinstance(spec, str) or not spec.startswith(f"{scheme}:"):
        raise ValueError(f"{scheme} backend spec must be {scheme}:DIR[?options], got {spec!r}")
    root, _, query = spec[len(scheme) + 1 :].partition("?")
    if not root:
        raise ValueError(f"storage spec '{scheme}:' needs a directory, e.g. {example}")
    keywords = set(known) | set(keyword_only)
    unknown = sorted(set(options) - keywords)
    if unknown:
        raise TypeError(f"unknown {scheme} backend options {unknown}; known: {sorted(keywords)}")
    values: dict[str, Any] = {}
    passed: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if passthrough and name.startswith(passthrough):
            passed[name[len(passthrough) :]] = value
        elif name in known:
            values[name] = value
        else:
            names = sorted(known) + ([f"{passthrough}NAME"] if passthrough else [])
            raise ValueError(
                f"{scheme} spec {spec!r}: unknown option {name!r}; known: {', '.join(names)}"
            )
    values.update(options)
    return DirSpec(root, values, passed)
