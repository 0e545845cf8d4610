"""`hicache sweep`'s grid: the points (L1 size, L2 size, L3 size) from the flags, and token
counts read and written as `100k`, `1.5M`, `262144`.

L3 sizes: `0` (none), `inf` (an unbounded store), a token count like the other tiers (`140k`:
the store holds that many tokens' pages, rounded down to whole pages) or a byte size with a
unit (`36MB`, `2GiB`: the framed bytes a store counts against its cap, as
`--storage-max-bytes` and the memory store's `capacity_bytes` do)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Point", "fmt_bytes", "fmt_tokens", "grid", "parse_storage", "parse_tokens"]

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
    storage: bool  # L3 on
    storage_tokens: int | None = None  # L3's cap in tokens (whole pages); None: see below
    storage_bytes: int | None = None  # L3's cap in framed bytes; both None: unbounded

    @property
    def capped(self) -> bool:
        return self.storage_tokens is not None or self.storage_bytes is not None

    @property
    def storage_label(self) -> str:
        if self.storage_tokens is not None:
            return fmt_tokens(self.storage_tokens)
        if self.storage_bytes is not None:
            return fmt_bytes(self.storage_bytes)
        return "inf" if self.storage else "0"


def fmt_bytes(n: int) -> str:
    """A byte size as `--storage` reads it back: 36000000 -> 36MB, 2147483648 -> 2GiB."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def parse_storage(text: str, *, page_size: int) -> Point:
    """One `--storage` item as a point's L3 (device and host sizes 0, to be filled in)."""
    s = text.strip()
    low = s.lower()
    if low in ("0", "none", "off"):
        return Point(0, 0, False)
    if low in ("inf", "infinite", "unbounded", "on"):
        return Point(0, 0, True)
    if low.endswith("b"):
        from hicache.backends.mooncake.spec import parse_size

        try:
            size = parse_size(s, f"--storage {s!r}")
        except ValueError:
            raise ValueError(f"--storage {s!r}: not a byte size (e.g. 36MB, 2GiB, 500GB)") from None
        if size <= 0:
            raise ValueError(f"--storage {s!r}: a capped L3 needs at least one byte")
        return Point(0, 0, True, storage_bytes=size)
    try:
        tokens = parse_tokens(s)
    except ValueError:
        raise ValueError(
            f"--storage {s!r}: L3 is 0 (none), inf (unbounded), a token count (140k) or a "
            "byte size (36MB, 2GiB)"
        ) from None
    pages = _pages(tokens, page_size)
    if pages <= 0:
        raise ValueError(
            f"--storage {s!r}: a capped L3 needs at least one page ({page_size} tokens)"
        )
    return Point(0, 0, True, storage_tokens=pages)


def grid(device: str, host: str, storage: str, *, page_size: int) -> list[Point]:
    """The points of a sweep, from the comma-separated flags."""
    points: list[Point] = []
    stores = [parse_storage(item, page_size=page_size) for item in storage.split(",")]
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
            points.extend(
                Point(dev, hst, st.storage, st.storage_tokens, st.storage_bytes) for st in stores
            )
    return list(dict.fromkeys(points))
