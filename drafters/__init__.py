"""Drafters: one ``Drafter`` protocol, a registry of kinds, and the implementations."""

from drafters.base import Drafter, Proposal
from drafters.registry import create_drafter, drafter_kinds, register_drafter

__all__ = ["Drafter", "Proposal", "create_drafter", "drafter_kinds", "register_drafter"]
