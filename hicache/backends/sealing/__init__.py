"""What a secret adds to L3 (docs/security.md).

- seal.py: `Seal`, the keys derived from the secret, keyed names and the sealing of one value;
- backend.py: `SealedBackend`, the wrapper that seals every value any backend stores
  (`seal_backend`, applied by the registry).

Nothing is imported here: keys.py needs `Seal` while the wrapper needs keys.py's `Namespace`.
"""
