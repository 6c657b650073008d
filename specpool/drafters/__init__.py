"""Drafters: one ``Drafter`` protocol, a registry of kinds, and the implementations."""

from specpool.drafters.base import Drafter, Proposal
from specpool.drafters.registry import create_drafter, drafter_kinds, register_drafter

__all__ = ["Drafter", "Proposal", "create_drafter", "drafter_kinds", "register_drafter"]
