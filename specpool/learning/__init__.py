"""Learning from verification feedback: feedback records and streams, the online learners, the
model store and hot swap, and the zoo's offline distillation (docs/ARCHITECTURE.md)."""
