"""`hicache sweep`'s grid: the points (L1 size, L2 size, L3 on/off) from the flags, and token
counts read and written as `100k`, `1.5M`, `262144`."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Point", "fmt_tokens", "grid", "parse_tokens"]

_SUFFIX = {"k": 1_000, "K": 1_000, "m": 1_000_000, "M": 1_000_000, "g": 10**9, "G": 10**9}


def parse_tokens(text: str) -> float:
    """`100k`, `1.5M`, `262144` -> tokens; `inf` -> math.inf."""
    t = text.strip()
    if t.lower() in ("inf", "infinite", "unbounded"):
        return math.inf
    scale = 1
    if t and t[-1] in _SUFFIX:
        t, scale = t[:-1], _SUFFIX[t[-1]]
    try:
        value = float(t) * scale
    except ValueError:
        raise ValueError(f"not a token count: {text!r} (e.g. 200k, 1.5M, 262144)") from None
    if not value >= 0:
        raise ValueError(f"not a token count: {text!r}")
    return value


def _pages(tokens: float, page: int) -> int:
    return int(tokens) // page * page


def fmt_tokens(n: float) -> str:
    """Three significant digits: 49984 -> 50.0k, 200000 -> 200k, 1000000 -> 1M."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:g}"


@dataclass(frozen=True, slots=True)
class Point:
    device_tokens: int
    host_tokens: int
    storage: bool

    @property
    def storage_label(self) -> str:
        return "inf" if self.storage else "0"


def grid(device: str, host: str, storage: str, *, page_size: int) -> list[Point]:
    """The points of a sweep, from the comma-separated flags."""
    points: list[Point] = []
    stores = []
    for item in storage.split(","):
        s = item.strip().lower()
        if s in ("0", "none", "off"):
            stores.append(False)
        elif s in ("inf", "infinite", "unbounded", "on"):
            stores.append(True)
        else:
            raise ValueError(
                f"--storage {s!r}: the sweep models L3 as 0 (none) or inf (an unbounded store)"
            )
    for d in device.split(","):
        dev = _pages(parse_tokens(d), page_size)
        if dev <= 0 or math.isinf(parse_tokens(d)):
            raise ValueError(f"--device {d!r}: needs at least one page ({page_size} tokens)")
        for item in host.split(","):
            h = item.strip()
            if h.endswith(("x", "X")):
                try:
                    factor = float(h[:-1])
                except ValueError:
                    raise ValueError(f"--host {h!r}: e.g. 2x, 4x or 400k") from None
                hst = _pages(dev * factor, page_size)
            else:
                hst = _pages(parse_tokens(h), page_size)
            if hst <= dev:
                raise ValueError(
                    f"--host {h!r}: L2 ({hst} tokens) must be larger than L1 ({dev} tokens)"
                )
            points.extend(Point(dev, hst, st) for st in stores)
    return list(dict.fromkeys(points))
