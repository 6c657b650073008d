"""Routing: the speculative loop, drafter choosers and their pure math. No torch, Ray or gRPC here."""
