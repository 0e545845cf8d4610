"""tests/aibrix runs in .venv-aibrix (`make aibrix-env`); the main venv skips it."""
