"""Child process for the tests of several replays on one store: `hicache replay` in a process of
its own that starts when told. It prints "ready" once the replay's imports are done, waits until
the pipe whose read end is file descriptor FD closes, then runs the replay with its arguments and
exits with the replay's status. The parent closes that pipe once every child is ready, so their
replays start together rather than one after another's imports.

    python -m tests.integration.replay_process FD [hicache replay arguments ...]
"""

from __future__ import annotations

import os
import sys

import hicache.cli.replay.command  # noqa: F401 - the replay's imports (torch), before "ready"
from hicache.cli.main import main

if __name__ == "__main__":
    start = int(sys.argv[1])
    print("ready", flush=True)
    while os.read(start, 1):  # returns b"" once the parent closed its end
        pass
    os.close(start)
    sys.exit(main(["replay", *sys.argv[2:]]))
