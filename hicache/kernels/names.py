"""The data plane's choices by name: host layouts and io backends.

The one list of each: `layouts.py` and `transfer.py` implement them, `config.py` validates a
configuration against them. Nothing here imports torch, so reading the names is cheap.
"""

from __future__ import annotations

from typing import Literal

Layout = Literal["layer_first", "page_first", "page_first_direct", "page_head"]
LAYOUTS: tuple[Layout, ...] = ("layer_first", "page_first", "page_first_direct", "page_head")
"""Host-pool layouts (layouts.py describes each)."""

IO = Literal["kernel", "direct"]
IO_BACKENDS: tuple[IO, ...] = ("kernel", "direct")
"""How a transfer moves pages (transfer.py): gather/scatter through index tensors, or one copy
per contiguous run."""

DEFAULT_TRANSFER_SMS = 8
"""SMs kernel io's copy kernel may occupy on CUDA (`CacheConfig.transfer_sms`): enough for the
link's speed, few enough that the model's kernels beside it keep nearly every SM."""

MAX_TRANSFER_SMS = 1024
"""The largest `transfer_sms` accepted (more than any GPU has)."""
