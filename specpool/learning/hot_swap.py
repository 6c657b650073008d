"""Serving the learner's versions: one slot per drafter variant, swapped between requests.

A request *pins* a slot's current (version, drafter) when it starts and uses that drafter object
for all its rounds; a swap only replaces what the *next* request pins. Each version is its own
``ZooDrafter`` (own network, own KV caches), so a request never mixes versions: not in weights,
not in cached keys/values. An old version lives on until its last request releases it.

The slot follows the store's serving version (``refresh``): the embedded learner calls it right
after promoting; a drafter replica in served mode calls ``maybe_refresh`` between requests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

from specpool.core.errors import InvalidArgument, ModelUnavailable
from specpool.drafters.zoo import ZooDrafter
from specpool.drafters.zoo_model import ZooLM
from specpool.learning.model_store import SHARED_SCOPE, ModelStore, VariantKey
from specpool.learning.zoo_weights import build_served_model

log = logging.getLogger("specpool.hot_swap")


def learnable(drafter) -> bool:
    """Online learning trains zoo drafters (small networks on a frozen shared embedding)."""
    return isinstance(drafter, ZooDrafter) and isinstance(drafter.model, ZooLM)


def version_drafter(base: ZooDrafter, store: ModelStore, key: VariantKey, version: int) -> ZooDrafter:
    """The drafter of one published version (0: ``base``, the shipped weights); raises when the
    store cannot give it."""
    if version == 0:
        return base
    tensors, metadata = store.load(key, version)
    model = build_served_model(base.model, tensors, metadata)
    return ZooDrafter(base.name, model, base.metadata, top_k=base.top_k, confidence_threshold=base.confidence_threshold)


class DrafterSlot:
    def __init__(self, key: VariantKey, base: ZooDrafter, store: ModelStore, refresh_every_s: float = 5.0):
        self.key = key
        self.base = base  # version 0: the shipped weights
        self.store = store
        self.refresh_every_s = refresh_every_s
        self._current: tuple[int, ZooDrafter] = (0, base)  # replaced whole: reads need no lock
        self._lock = threading.Lock()  # one refresh at a time
        self._checked = 0.0
        self.swaps = 0
        self.load_errors = 0

    def pin(self) -> tuple[int, ZooDrafter]:
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

    def __init__(self, base: ZooDrafter, store: ModelStore, shared: bool = False, refresh_every_s: float = 5.0,
                 keep: int = 4, max_tenants: int = 256):
        if max_tenants < 1 or keep < 1:
            raise InvalidArgument(f"max_tenants and keep must be >= 1, got {max_tenants}, {keep}")
        self.base, self.store, self.shared, self.refresh_every_s, self.keep = base, store, shared, refresh_every_s, keep
        self.max_tenants = max_tenants
        self.evicted = 0
        self._slots: OrderedDict[VariantKey, DrafterSlot] = OrderedDict()  # least recently used first
        self._held: OrderedDict[tuple[VariantKey, int], ZooDrafter] = OrderedDict()
        self._lock = threading.Lock()

    def key(self, tenant: str) -> VariantKey:
        return VariantKey(SHARED_SCOPE if self.shared else tenant, self.base.name)

    def pick(self, tenant: str, version: int = 0, exact: bool = False) -> tuple[int, ZooDrafter]:
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
