"""What a secret adds to L3 (docs/security.md): `SealedBackend` (backend.py), the wrapper that
seals every value any backend stores (`seal_backend`, applied by the registry). The `Seal` itself,
the keys derived from the secret, is hicache/seal.py.
"""
