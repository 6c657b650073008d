"""Drafters: one ``Drafter`` protocol, a registry of kinds, and the implementations.

Importing this package registers the built-in kinds (each kind's module registers itself with
``@register_drafter`` on import); ``specpool.drafters.registry`` only holds the table, so the
kinds import the registry and nothing imports back (no cycle).
"""

# The built-in kinds, imported for their registration.
from specpool.drafters import eagle, hf_model, lookup_first, ngram, zoo  # noqa: F401
from specpool.drafters.base import Drafter, Proposal
from specpool.drafters.registry import create_drafter, drafter_kinds, register_drafter

__all__ = ["Drafter", "Proposal", "create_drafter", "drafter_kinds", "register_drafter"]
