"""`hicache replay`: a trace through the cache with real bytes moved.

- command.py: the command (`run`) and the replay loop (`replay`);
- args.py: the flags as a cache configuration; step.py: one scheduler step;
- hybrid.py: `--hybrid`, the trace through `HybridCache`;
- report.py, progress.py, link.py: the summary and table, the live display, link utilization;
- exit.py: how a replay ends when told to stop, and what it leaves behind.
"""
