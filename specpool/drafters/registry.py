"""Drafter kinds by name. A drafter spec is ``KIND`` or ``KIND:ARGUMENT`` (``ngram``,
``hf:/path/to/model``); kinds register themselves with ``@register_drafter``.

This module only holds the table: it imports no drafter kind. The built-in kinds register when
``specpool.drafters`` is imported (its ``__init__`` imports them), which Python does before any
``specpool.drafters.*`` module, so the table is full whenever this module is usable and the
kinds can import it without a cycle (docs/ARCHITECTURE.md, layers)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specpool.drafters.base import LOOKUP_SOURCE, Drafter
from specpool.core.errors import NotFound


@dataclass(frozen=True)
class DrafterContext:
    """What any drafter may need to build itself."""

    home: Path  # specpool's cache directory (models, converted weights)
    target: str = "smollm2-135m-instruct"  # the target model's name, for drafters derived from it
    device: str = "cpu"
    dtype: str = "auto"


DrafterFactory = Callable[[str, str, DrafterContext], Drafter]  # (name, argument, context)
NameResolver = Callable[[str], "str | None"]  # bare name -> full spec, or None
_KINDS: dict[str, DrafterFactory] = {}
_RESOLVERS: list[NameResolver] = []


def register_drafter(kind: str) -> Callable[[DrafterFactory], DrafterFactory]:
    def add(factory: DrafterFactory) -> DrafterFactory:
        _KINDS[kind] = factory
        return factory

    return add


def register_name_resolver(resolver: NameResolver) -> NameResolver:
    """Let bare names (``code``) stand for full specs (``zoo:code``)."""
    _RESOLVERS.append(resolver)
    return resolver


def resolve_spec(spec: str) -> str:
    """The full ``KIND:ARGUMENT`` spec for ``spec`` (bare shipped names resolved)."""
    if spec.partition(":")[0] in _KINDS:
        return spec
    for resolver in _RESOLVERS:
        resolved = resolver(spec)
        if resolved is not None:
            return resolved
    return spec


# Kinds whose proposals can come from prompt lookup (specpool.drafters.base.LOOKUP_SOURCE). By name, not by
# building the drafter, so a router that only holds remote drafters can tell too.
_LOOKUP_KINDS = ("ngram", "lookup")


def shared_sources(specs: list[str]) -> frozenset[str]:
    """The proposal sources that two or more of these drafters share: rounds from them cannot tell
    the drafters apart. ``ngram`` + ``lookup:code`` share the lookup; ``ngram`` + ``code`` share nothing."""
    with_lookup = {s for s in specs if s.partition(":")[0] in _LOOKUP_KINDS}
    return frozenset({LOOKUP_SOURCE}) if len(with_lookup) >= 2 else frozenset()


def known_spec(spec: str) -> bool:
    return resolve_spec(spec).partition(":")[0] in _KINDS


def drafter_kinds() -> list[str]:
    return sorted(_KINDS)


def create_drafter(spec: str, context: DrafterContext) -> Drafter:
    """Build the drafter a spec names; the spec itself becomes the drafter's name."""
    kind, _, argument = resolve_spec(spec).partition(":")
    factory = _KINDS.get(kind)
    if factory is None:
        raise NotFound(f"unknown drafter {spec!r}; known kinds: {', '.join(sorted(_KINDS))} (hf:PATH_OR_HUB_ID for a model)")
    return factory(spec, argument, context)

