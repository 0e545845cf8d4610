"""`hicache check-log`: re-derive what an event log says happened and check its invariants.

- command.py: the command, `check_events` and `check_file`;
- read.py: reading the log and the report; runs.py: runs, requests and L1;
- ops.py: the ops the tree hands its workers; slots.py: who owns each L1 slot.
"""

from hicache.cli.checklog.command import check_events
from hicache.cli.checklog.read import Violation

__all__ = ["Violation", "check_events"]
