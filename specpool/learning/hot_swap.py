"""Serving the learner's versions: one slot per drafter variant, swapped between requests.

A request *pins* a slot's current (version, drafter) when it starts and uses that drafter object
for all its rounds; a swap only replaces what the *next* request pins. Each version is its own
drafter (``ZooDrafter`` or ``EagleDrafter``: own network, own KV caches or feature logs), so a
request never mixes versions: not in weights, not in cached keys/values. An old version lives on
until its last request releases it.

The slot follows the store's serving version (``refresh``): the embedded learner calls it right
after promoting; a drafter replica in served mode calls ``maybe_refresh`` between requests.

Which drafters learn, and how, is one table (``LEARNABLE``, one ``LearnableKind`` per drafter
kind): zoo drafters (a ``ZooLM``: specpool/learning/online.py) and white-box heads (an
``EagleHead``: specpool/learning/online_heads.py). The learner loop, the embedded wiring and the
served drafter replicas look a drafter or network up there, never by its kind's name.

Prompt lookup in front of a learnable drafter (``lookup:eagle-alt-int8:general``, the default drafter;
``lookup:code``) learns too: what learns is the drafter behind the lookup (``behind_lookup``),
and a version is that drafter's new network behind a lookup of its own. The lookup itself has no
weights. Its rounds still teach the network: a record is the context, the target's answer and
(white-box) the target's features, whoever proposed the draft.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from specpool.core.errors import InvalidArgument, ModelUnavailable
from specpool.drafters.base import Drafter
from specpool.drafters.eagle import EagleDrafter
from specpool.drafters.eagle_model import EagleHead
from specpool.drafters.lookup_first import LookupFirstDrafter
from specpool.drafters.zoo import ZooDrafter
from specpool.drafters.zoo_model import ZooLM
from specpool.learning.evaluation import record_bd
from specpool.learning.feedback import BadFeedback, FeedbackRecord
from specpool.learning.model_store import SHARED_SCOPE, ModelStore, VariantKey
from specpool.learning.online import OnlineDrafterLearner
from specpool.learning.online_heads import OnlineHeadLearner, build_served_head, check_head_record, head_record_bd
from specpool.learning.zoo_weights import build_served_model

log = logging.getLogger("specpool.hot_swap")


@dataclass(frozen=True)
class LearnableKind:
    """What online learning needs of one drafter kind it trains."""

    drafter: type  # the drafter class
    network: type  # the class of its network (what the learner trains)
    network_of: Callable[[Any], nn.Module]  # a drafter's network
    learner: type[OnlineDrafterLearner]  # the online learner of one variant
    served_network: Callable[[Any, dict[str, torch.Tensor], dict], nn.Module]  # (base, tensors, metadata) -> a version's network
    record_bd: Callable[[nn.Module, Sequence[FeedbackRecord], str], list[torch.Tensor]]  # held-out BD per record
    check_record: Callable[[FeedbackRecord, Any], None]  # raises BadFeedback for a record it cannot learn from
    rebuild: Callable[[Any, nn.Module], Drafter]  # (base drafter, a version's network) -> that version's drafter


def _check_vocabulary(record: FeedbackRecord, network) -> None:
    vocab_size = network.embedding.shape[0]
    if any(t >= vocab_size for t in record.context + record.draft) or \
            any(t >= vocab_size for row in record.target_ids for t in row):
        raise BadFeedback("out_of_range", f"token ids outside the drafter's vocabulary of {vocab_size}")


def _check_head_record(record: FeedbackRecord, head: EagleHead) -> None:
    _check_vocabulary(record, head)
    check_head_record(record, head)


LEARNABLE: tuple[LearnableKind, ...] = (
    LearnableKind(
        ZooDrafter, ZooLM, lambda d: d.model, OnlineDrafterLearner, build_served_model, record_bd, _check_vocabulary,
        lambda base, model: ZooDrafter(base.name, model, base.metadata, top_k=base.top_k,
                                       confidence_threshold=base.confidence_threshold)),
    LearnableKind(
        EagleDrafter, EagleHead, lambda d: d.head, OnlineHeadLearner, build_served_head, head_record_bd, _check_head_record,
        lambda base, head: EagleDrafter(base.name, head, base.metadata, top_k=base.top_k,
                                        confidence_threshold=base.confidence_threshold, cache_capacity=base.cache_capacity,
                                        tree_nodes=base.tree_nodes, tree_beam=base.tree_beam, tree_min_prob=base.tree_min_prob,
                                        alternatives=base.alternatives, alt_min_prob=base.alt_min_prob,
                                        alt_per_depth=base.alt_per_depth)),
)


def behind_lookup(drafter):
    """The drafter that drafts where prompt lookup finds nothing (``lookup:SPEC`` -> SPEC's
    drafter); ``drafter`` itself when no lookup is in front of it."""
    while isinstance(drafter, LookupFirstDrafter):
        drafter = drafter.inner
    return drafter


def drafter_kind(drafter) -> LearnableKind | None:
    """The kind that trains ``drafter``, or the drafter behind its prompt lookup (None: it does
    not learn online)."""
    inner = behind_lookup(drafter)
    return next((k for k in LEARNABLE if isinstance(inner, k.drafter) and isinstance(k.network_of(inner), k.network)), None)


def network_kind(network) -> LearnableKind:
    """The kind whose learner trains ``network`` (a drafter's network from ``network_of``)."""
    kind = next((k for k in LEARNABLE if isinstance(network, k.network)), None)
    if kind is None:
        raise InvalidArgument(f"online learning does not train a {type(network).__name__}")
    return kind


def learnable(drafter) -> bool:
    """Online learning trains zoo drafters (small networks on a frozen shared embedding) and
    white-box heads (``LEARNABLE``)."""
    return drafter_kind(drafter) is not None


def network_of(drafter) -> nn.Module | None:
    """The network online learning trains in ``drafter`` (None: it does not learn)."""
    inner = behind_lookup(drafter)
    kind = drafter_kind(inner)
    return kind.network_of(inner) if kind is not None else None


def version_drafter(base: Drafter, store: ModelStore, key: VariantKey, version: int) -> Drafter:
    """The drafter of one published version (0: ``base``, the shipped weights); raises when the
    store cannot give it."""
    if version == 0:
        return base
    kind = drafter_kind(base)
    if kind is None:
        raise InvalidArgument(f"drafter {key.drafter!r} does not learn online")
    tensors, metadata = store.load(key, version)
    return _rebuilt(base, kind, tensors, metadata)


def _rebuilt(base: Drafter, kind: LearnableKind, tensors: dict[str, torch.Tensor], metadata: dict) -> Drafter:
    """``base`` with a version's network: the same lookup(s) in front, each a new one (a version
    is a drafter of its own, sharing no per-session state with the others)."""
    if isinstance(base, LookupFirstDrafter):
        return LookupFirstDrafter(base.name, _rebuilt(base.inner, kind, tensors, metadata))
    return kind.rebuild(base, kind.served_network(kind.network_of(base), tensors, metadata))


class DrafterSlot:
    def __init__(self, key: VariantKey, base: Drafter, store: ModelStore, refresh_every_s: float = 5.0):
        self.key = key
        self.base = base  # version 0: the shipped weights
        self.store = store
        self.refresh_every_s = refresh_every_s
        self._current: tuple[int, Drafter] = (0, base)  # replaced whole: reads need no lock
        self._lock = threading.Lock()  # one refresh at a time
        self._checked = 0.0
        self.swaps = 0
        self.load_errors = 0

    def pin(self) -> tuple[int, Drafter]:
        """The (version, drafter) a starting request uses throughout."""
        return self._current

    @property
    def version(self) -> int:
        return self._current[0]

    def maybe_refresh(self) -> int:
        if time.monotonic() - self._checked >= self.refresh_every_s:
            return self.refresh()
        return self.version

    def refresh(self) -> int:
        """Load the store's serving version if it is not the one served; returns the version served.
        A version that fails to load is logged and counted, and the current one stays."""
        with self._lock:
            self._checked = time.monotonic()
            try:
                wanted = self.store.serving(self.key) or 0
                if wanted == self._current[0]:
                    return wanted
                drafter = version_drafter(self.base, self.store, self.key, wanted)
            except Exception as exc:  # noqa: BLE001 - serving goes on with the version it has
                self.load_errors += 1
                log.warning("drafter %s (%s): keeping version %d, could not load the serving one: %s",
                            self.key.drafter, self.key.scope, self._current[0], exc)
                return self._current[0]
            self._current = (wanted, drafter)
            self.swaps += 1
            log.info("drafter %s (%s): now serving version %d", self.key.drafter, self.key.scope, wanted)
            return wanted


class ServedVariants:
    """A served drafter replica's learned versions, per tenant (or one shared variant).

    Served mode spreads a request's rounds over calls, possibly over replicas, so the pin travels
    with the calls: the first round of a request (``exact`` False) drafts with the tenant's
    serving version - its slot refreshed at most every ``refresh_every_s`` - and the router sends
    that version back with every later round (``exact`` True), which gets exactly it: from the
    versions this replica holds (the ``keep`` most recently used) or, on a replica that never
    served it (failover), loaded from the store. So a request never mixes versions, and a new
    version reaches a tenant's next request within ``refresh_every_s``.

    Memory is bounded however many tenants there are: at most ``max_tenants`` slots, the least
    recently used dropped (its tenant's next request makes a new one, reading the store again). A
    dropped slot's drafter is safe to drop: a version in use is also among the ``keep`` held ones
    (which ``release`` still reaches), and version 0 is ``base``.
    """

    def __init__(self, base: Drafter, store: ModelStore, shared: bool = False, refresh_every_s: float = 5.0,
                 keep: int = 4, max_tenants: int = 256):
        if max_tenants < 1 or keep < 1:
            raise InvalidArgument(f"max_tenants and keep must be >= 1, got {max_tenants}, {keep}")
        self.base, self.store, self.shared, self.refresh_every_s, self.keep = base, store, shared, refresh_every_s, keep
        self.max_tenants = max_tenants
        self.evicted = 0
        self._slots: OrderedDict[VariantKey, DrafterSlot] = OrderedDict()  # least recently used first
        self._held: OrderedDict[tuple[VariantKey, int], Drafter] = OrderedDict()
        self._lock = threading.Lock()

    def key(self, tenant: str) -> VariantKey:
        return VariantKey(SHARED_SCOPE if self.shared else tenant, self.base.name)

    def pick(self, tenant: str, version: int = 0, exact: bool = False) -> tuple[int, Drafter]:
        """(version, drafter) for a round of ``tenant``'s request; see the class docstring."""
        if not tenant:  # a caller that names no tenant gets the shipped weights
            if exact and version != 0:
                raise ModelUnavailable(f"drafter {self.base.name!r}: weights version {version} needs the request's tenant")
            return 0, self.base
        key = self.key(tenant)
        with self._lock:
            if not exact:
                slot = self._slots.get(key)
                if slot is None:
                    while len(self._slots) >= self.max_tenants:
                        self._slots.popitem(last=False)
                        self.evicted += 1
                    slot = self._slots[key] = DrafterSlot(key, self.base, self.store, self.refresh_every_s)
                    slot.refresh()
                else:
                    self._slots.move_to_end(key)
                    slot.maybe_refresh()
                version, drafter = slot.pin()
            elif version == 0:
                drafter = self.base
            elif (key, version) in self._held:
                drafter = self._held[(key, version)]
            else:
                try:
                    drafter = version_drafter(self.base, self.store, key, version)
                except Exception as exc:  # noqa: BLE001 - the request cannot go on with other weights
                    raise ModelUnavailable(f"drafter {self.base.name!r} ({key.scope}): weights version {version} "
                                           f"cannot be loaded ({exc})") from None
            if version:
                self._held[(key, version)] = drafter
                self._held.move_to_end((key, version))
                while len(self._held) > self.keep:
                    self._held.popitem(last=False)  # its caches go with it
            return version, drafter

    def release(self, session_id: str) -> None:
        with self._lock:
            drafters = [self.base, *self._held.values(), *(slot.pin()[1] for slot in self._slots.values())]
        for drafter in {id(d): d for d in drafters}.values():
            drafter.release(session_id)
