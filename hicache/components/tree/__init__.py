"""The radix tree component: its pure core (core.py) and, later, its actor."""
