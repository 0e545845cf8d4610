"""SGLang's own host pools and storage classes on a CPU-only machine, for tests/sglang and
bench/sglang_storage.py. Run with SGLang's venv (`make sglang-env`: SGLang 0.5.23 without its
CUDA dependency tree); elsewhere `sglang_missing()` says why not.

Stand-ins (everything else is SGLang's code):
- torchvision: SGLang's model configs import it at module level; its wheels need a CUDA
  torch, so an import-only module takes its place (nothing on the cache path calls it);
- the host allocator: SGLang pins host buffers with cudaHostRegister; here plain memory;
- the device <-> host copy of MHA pools (`transfer_kv_direct`, from sgl_kernel on GPUs):
  a per-layer index copy;
- `get_parallel()`: SGLang's runtime context of one rank, set as its own tests set it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Any


class _AnyMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any

    def __iter__(cls) -> Any:
        return iter(())


class _Any(metaclass=_AnyMeta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Any()


class _TorchvisionFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import-only torchvision: every attribute is a placeholder class."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__version__ = "0.0"

        def __getattr__(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Any

        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _install_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is not None:
        return
    if not any(isinstance(f, _TorchvisionFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionFinder())


def sglang_missing() -> str | None:
    """Why SGLang's storage classes cannot be used here (None: they can)."""
    try:
        spec = importlib.util.find_spec("sglang.srt")
    except ImportError:
        spec = None
    if spec is None:
        return "SGLang is not installed here (make sglang-env; .venv-sglang/bin/python -m pytest tests/sglang)"
    _install_torchvision()
    warnings.filterwarnings("ignore", module="sglang")
    try:
        import sglang.srt.managers.cache_controller
        import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure to import means: skip, saying why
        return f"SGLang does not import here: {exc!r}"
    return None


def cpu_standins() -> None:
    """Install the CPU stand-ins (idempotent)."""
    import sglang.srt.mem_cache.pool_host.common as common
    import sglang.srt.mem_cache.pool_host.mha as mha

    pinned = common.alloc_with_pin_memory  # SGLang's own, left in place: the table changes

    def alloc_plain(
        dims: Any, dtype: Any, device: Any, pin_memory: bool, allocator: Any, **kw: Any
    ) -> Any:
        return pinned(dims, dtype=dtype, device=device, pin_memory=False, allocator=allocator, **kw)

    def transfer_kv_direct(
        src_layers: Any, dst_layers: Any, src_indices: Any, dst_indices: Any, page_size: int
    ) -> None:
        for src, dst in zip(src_layers, dst_layers):
            dst[dst_indices] = src[src_indices]

    common.ALLOC_MEMORY_FUNCS["cpu"] = alloc_plain
    mha.transfer_kv_direct = transfer_kv_direct


MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def mha_host(
    layout: str,
    *,
    page_size: int = 4,
    layers: int = 3,
    heads: int = 2,
    head_dim: int = 8,
    tokens: int = 64,
    dtype: Any = None,
) -> Any:
    """SGLang's MHA device pool on CPU and its host pool in `layout`, filled with random bytes."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    cpu_standins()
    device = MHATokenToKVPool(
        tokens,
        page_size,
        dtype or torch.bfloat16,
        heads,
        head_dim,
        layers,
        "cpu",
        False,
        start_layer=0,
        end_layer=layers - 1,
    )
    host = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        page_size,
        layout,
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=layers - 1,
        pin_memory=False,
    )
    fill_random(host.kv_buffer)
    return host


def mla_host(
    layout: str,
    *,
    page_size: int = 4,
    layers: int = 3,
    rank: int = 16,
    rope: int = 8,
    tokens: int = 64,
) -> Any:
    """SGLang's MLA device pool on CPU and its host pool in `layout`, filled with random bytes."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    cpu_standins()
    device = MLATokenToKVPool(
        tokens, page_size, torch.bfloat16, rank, rope, layers, "cpu", False, 0, layers - 1
    )
    host = MLATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        page_size,
        layout,
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=layers - 1,
        target_layer_num=layers,
        pin_memory=False,
    )
    fill_random(host.kv_buffer)
    return host


def mamba_host(*, slots: int = 8) -> Any:
    """SGLang's Mamba state host pool (page size 1, a page is a slot), random bytes."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    cpu_standins()
    info = MambaStateBufferInfo(
        temporal=torch.zeros(2, slots + 1, 3, 4),
        conv=(torch.zeros(2, slots + 1, 5, dtype=torch.bfloat16),),
    )
    host = MambaPoolHost(info, 2, 0, device_capacity=slots, pin_memory=False, layout="page_first")
    for slot in range(host.size):
        page = host.get_dummy_flat_data_page()
        fill_random(page, seed=slot)
        host.set_from_flat_data_page(slot, page)
    return host


def fill_random(t: Any, seed: int = 0) -> None:
    """Random bytes in every element (a bit-for-bit check then means something)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    raw = t.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def storage_config(
    *,
    extra: dict[str, Any],
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    model: str | None = "test/model",
    metrics: bool = False,
) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=False,
        model_name=model,
        extra_config=dict(extra),
    )


def dynamic_extra(storage: str, **options: Any) -> dict[str, Any]:
    """The extra config that loads hicache's backend through SGLang's dynamic loader."""
    return {
        "backend_name": "hicache",
        "module_path": "hicache.integrations.sglang",
        "class_name": "HiCacheL3Storage",
        "interface_v1": 1,
        "storage": storage,
        **options,
    }


def open_dynamic(host: Any, storage: str, **kw: Any) -> Any:
    """hicache's backend built by SGLang's own factory (`dynamic`), the host pool registered."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    options = kw.pop("options", {})
    config = storage_config(extra=dynamic_extra(storage, **options), **kw)
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    return backend
