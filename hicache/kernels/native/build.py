"""Building the compiled helpers (the row copier, the file store's loops) with the system C
compiler, into a cache shared by processes.

Environment:
- `HICACHE_NATIVE=0` disables every compiled helper;
- `HICACHE_CACHE_DIR` is where the built libraries are kept (default `$XDG_CACHE_HOME/hicache`,
  else `~/.cache/hicache`); a file name carries a hash of the source, the compiler command
  and the machine, so an edited source or another compiler builds anew;
- `CC` names the compiler (default `cc`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
from pathlib import Path

_COMPILE_SECONDS = 120


def cache_dir() -> Path:
    explicit = os.environ.get("HICACHE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hicache"


def compiler() -> list[str]:
    """The C compiler command (`CC`, default `cc`)."""
    return shlex.split(os.environ.get("CC") or "cc")


def disabled() -> bool:
    """`HICACHE_NATIVE=0` (or false/no/off) turns every compiled helper off."""
    return os.environ.get("HICACHE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def cached_library(
    stem: str, source: Path, flags: list[str], *extra: str, suffix: str = ".so"
) -> Path:
    """Where the build of `source` with `flags` lives: the name carries a hash of the source,
    the compiler command, the machine and `extra` (say, the interpreter a module is for)."""
    digest = hashlib.sha256()
    digest.update(source.read_bytes())
    digest.update(" ".join(compiler() + flags).encode())
    digest.update(platform.machine().encode())
    for part in extra:
        digest.update(part.encode())
    return cache_dir() / f"{stem}-{digest.hexdigest()[:16]}{suffix}"


def build_library(source: Path, target: Path, flags: list[str]) -> None:
    """Compile `source` into a temporary file next to `target`, then rename: concurrent
    builders (test workers, TP ranks, worker threads) never load a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [*compiler(), *flags, "-o", tmp, str(source)],
            capture_output=True,
            text=True,
            timeout=_COMPILE_SECONDS,
            check=False,
        )
        if done.returncode != 0:
            raise OSError(
                f"{' '.join(compiler())} failed ({done.returncode}): {done.stderr.strip()[:500]}"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library(stem: str, source: Path, flags: list[str], abi: int) -> ctypes.CDLL:
    """The build of `source` (made first if missing), loaded as a CDLL (its calls release the
    GIL), after checking that its `hicache_<stem>_abi()` returns `abi`. OSError or
    SubprocessError where it cannot be built or is another ABI."""
    path = cached_library(stem, source, flags)
    if not path.exists():
        build_library(source, path, flags)
    lib = ctypes.CDLL(str(path))
    check = getattr(lib, f"hicache_{stem}_abi")
    check.restype = ctypes.c_int64
    found = check()
    if found != abi:
        raise OSError(f"{path} has ABI {found}, expected {abi}")
    return lib
