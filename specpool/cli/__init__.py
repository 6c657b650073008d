"""The ``specpool`` command: the top layer, wiring everything below (docs/ARCHITECTURE.md)."""
