"""hicache: a hierarchical KV cache (device, host, storage) for LLM serving engines."""

__version__ = "0.1.0"
