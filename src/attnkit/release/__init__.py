"""The release path: its shared steps (steps.py) and the local rehearsal of it (rehearsal.py)."""
