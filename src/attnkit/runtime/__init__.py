"""The runtime: probe the machine, check backends against a call, select, run."""
