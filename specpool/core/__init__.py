"""The bottom layer: domain errors, defaults and limits. Standard library only (no torch), so the
gRPC client and every other layer can import it (docs/ARCHITECTURE.md)."""
