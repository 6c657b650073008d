"""Processes: the CLI, the embedded engine wiring, and (later) servers and workers."""
