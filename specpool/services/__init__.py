"""Serving: the request orchestrator, the Ray Serve applications, the gRPC edges, and the
process settings (docs/ARCHITECTURE.md)."""
