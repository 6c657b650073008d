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

from drafters.model_store import ModelStore, VariantKey
from drafters.online import build_served_model
from drafters.zoo import ZooDrafter
from drafters.zoo_model import ZooLM

log = logging.getLogger("specpool.hot_swap")


def learnable(drafter) -> bool:
    """Online learning trains zoo drafters (small networks on a frozen shared embedding)."""
    return isinstance(drafter, ZooDrafter) and isinstance(drafter.model, ZooLM)


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
                if wanted == 0:
                    drafter = self.base
                else:
                    tensors, metadata = self.store.load(self.key, wanted)
                    model = build_served_model(self.base.model, tensors, metadata)
                    drafter = ZooDrafter(self.base.name, model, self.base.metadata, top_k=self.base.top_k,
                                         confidence_threshold=self.base.confidence_threshold)
            except Exception as exc:  # noqa: BLE001 - serving goes on with the version it has
                self.load_errors += 1
                log.warning("drafter %s (%s): keeping version %d, could not load the serving one: %s",
                            self.key.drafter, self.key.scope, self._current[0], exc)
                return self._current[0]
            self._current = (wanted, drafter)
            self.swaps += 1
            log.info("drafter %s (%s): now serving version %d", self.key.drafter, self.key.scope, wanted)
            return wanted
