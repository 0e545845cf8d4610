"""`hicache sweep`: hit rate per tier against capacity, from the control plane alone.

- command.py: the command; grid.py: the points and token counts;
- points.py: one replay per point; table.py: the CSV; plot.py: the PNG.
"""
