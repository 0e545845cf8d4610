"""Adapters that plug hicache into serving engines it does not own.

- `hicache.integrations.vllm`: `HiCacheConnector`, a vLLM KV connector (v1) that gives vLLM
  hicache's host tier (L2) and storage tier (L3) under vLLM's own paged KV cache (L1).
  docs/vllm.md.

Each adapter imports its engine only when loaded, so hicache never depends on an engine.
"""
