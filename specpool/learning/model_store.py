"""Versioned drafter weights for online learning: the learner publishes, drafters load.

A *variant* is one drafter as one tenant scope sees it (``VariantKey``): a tenant's own copy, or
the shared pool's. Each variant has numbered versions (1, 2, ...; 0 means the shipped weights,
never stored) and one *serving* version, the one drafters load. Publishing and promoting are
separate steps so that the learner can check a new version before anyone serves it, and a
rejected version stays on disk for inspection, marked rolled back.

``DirectoryModelStore`` keeps everything in a folder (local disk or a shared filesystem):

    <root>/<scope>/<drafter>/v000007/weights.safetensors   # the version's tensors
    <root>/<scope>/<drafter>/v000007/meta.json
    <root>/<scope>/<drafter>/SERVING                        # "7": the version drafters load
    <root>/<scope>/<drafter>/learner_state.safetensors      # the learner's checkpoint
    <root>/_dead_letters/<time>-<entry>.json                # records the learner gave up on

Every write goes to a temporary name first, is fsynced, and is renamed into place, the folder then
fsynced too (specpool/learning/durable.py): a reader sees a whole version or none, a crash or a
power loss leaves at most a hidden temporary behind, and a full disk is one clear error. Nothing
here is a pickle: tensors are safetensors, the rest JSON, so reading a store never runs code. Another URI scheme
(an object store, say) implements the ``ModelStore`` protocol and is handed to
``open_model_store`` through its ``schemes`` argument.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable
from urllib.parse import urlsplit

import torch
from safetensors.torch import load_file, save as save_tensors

from specpool.core.errors import InvalidArgument, ModelUnavailable, NotFound
from specpool.learning.durable import atomic_write, decode_state, disk_full, encode_state, fsync_dir, write_synced
from specpool.router.session_store import TENANT_PATTERN

SHARED_SCOPE = "_shared"  # the shared pool's scope (no tenant id starts with "_")
DEAD_LETTERS = "_dead_letters"  # the folder of dead-lettered records (no tenant id starts with "_")
STATE_FILE = "learner_state.safetensors"
LEGACY_STATE_FILE = "learner_state.pt"  # a pickle (torch.save) of older versions: refused, never loaded


@dataclass(frozen=True)
class VariantKey:
    scope: str  # a tenant id, or SHARED_SCOPE
    drafter: str  # the drafter's name (its spec)

    def __post_init__(self) -> None:
        if self.scope != SHARED_SCOPE and TENANT_PATTERN.fullmatch(self.scope) is None:
            raise InvalidArgument(f"invalid variant scope {self.scope!r}")
        if not self.drafter:
            raise InvalidArgument("a variant needs a drafter name")

    def folder(self) -> str:
        """A filesystem-safe, collision-free name for the drafter (a spec may be a path)."""
        readable = re.sub(r"[^A-Za-z0-9_.-]", "_", self.drafter)[-48:].lstrip(".") or "drafter"
        return f"{readable}-{hashlib.sha1(self.drafter.encode()).hexdigest()[:10]}"


@runtime_checkable
class ModelStore(Protocol):
    describe: str

    def publish(self, key: VariantKey, tensors: dict[str, torch.Tensor], metadata: dict) -> int:
        """Store a new version (not served yet); returns its number."""
        ...

    def promote(self, key: VariantKey, version: int) -> None:
        """Make ``version`` the serving one (atomically)."""
        ...

    def serving(self, key: VariantKey) -> int | None:
        """The serving version, or None when nothing was promoted (drafters use version 0)."""
        ...

    def load(self, key: VariantKey, version: int) -> tuple[dict[str, torch.Tensor], dict]:
        ...

    def mark_rolled_back(self, key: VariantKey, version: int, reason: str) -> None:
        ...

    def versions(self, key: VariantKey) -> list[int]:
        ...

    def save_state(self, key: VariantKey, state: dict) -> None:
        """The learner's checkpoint for this variant (replaced atomically)."""
        ...

    def load_state(self, key: VariantKey) -> dict | None:
        ...

    def dead_letter(self, entry_id: str, payload: bytes, reason: str) -> None:
        """Keep a record the learner gives up on, durably (it is acknowledged only after)."""
        ...


class DirectoryModelStore:
    def __init__(self, root: Path | str, keep_versions: int = 5):
        self.root = Path(root).expanduser()
        self.keep_versions = keep_versions  # older versions than this many are deleted (never the serving one)
        self.describe = str(self.root)

    def _dir(self, key: VariantKey) -> Path:
        return self.root / key.scope / key.folder()

    @staticmethod
    def _version_dir(folder: Path, version: int) -> Path:
        return folder / f"v{version:06d}"

    def versions(self, key: VariantKey) -> list[int]:
        folder = self._dir(key)
        if not folder.is_dir():
            return []
        return sorted(int(p.name[1:]) for p in folder.iterdir() if re.fullmatch(r"v\d{6}", p.name))

    def publish(self, key: VariantKey, tensors: dict[str, torch.Tensor], metadata: dict) -> int:
        folder = self._dir(key)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".publish-"))
        except OSError as exc:
            raise _os_error(folder, exc) from None
        try:
            write_synced(tmp / "weights.safetensors",
                         save_tensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()}))
            version = (self.versions(key) or [0])[-1] + 1
            while True:  # another publisher may take a number first: rename fails, take the next
                meta = dict(metadata, version=version, drafter=key.drafter, scope=key.scope)
                write_synced(tmp / "meta.json", json.dumps(meta, indent=1).encode())
                fsync_dir(tmp)  # both files' names are on disk before the folder gets its version's name
                try:
                    os.rename(tmp, self._version_dir(folder, version))
                    break
                except OSError:
                    if not self._version_dir(folder, version).exists():
                        raise
                    version += 1
            fsync_dir(folder)  # the version's name is on disk before anyone can promote it
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)  # never a half-written version
            if isinstance(exc, OSError):
                raise _os_error(tmp, exc) from None
            raise
        self._prune(key)
        return version

    def promote(self, key: VariantKey, version: int) -> None:
        if not self._version_dir(self._dir(key), version).is_dir():
            raise NotFound(f"{key.scope}/{key.drafter} has no version {version}")
        atomic_write(self._dir(key) / "SERVING", f"{version}\n".encode())

    def serving(self, key: VariantKey) -> int | None:
        try:
            return int((self._dir(key) / "SERVING").read_text().strip())
        except FileNotFoundError:
            return None
        except ValueError as exc:
            raise ModelUnavailable(f"{self._dir(key) / 'SERVING'} is corrupted ({exc})") from None

    def load(self, key: VariantKey, version: int) -> tuple[dict[str, torch.Tensor], dict]:
        folder = self._version_dir(self._dir(key), version)
        try:
            return load_file(str(folder / "weights.safetensors")), json.loads((folder / "meta.json").read_text())
        except FileNotFoundError:
            raise NotFound(f"{key.scope}/{key.drafter} has no version {version} in {self.root}") from None
        except Exception as exc:  # noqa: BLE001
            raise ModelUnavailable(f"version {version} of {key.scope}/{key.drafter} is unreadable ({exc})") from None

    def mark_rolled_back(self, key: VariantKey, version: int, reason: str) -> None:
        folder = self._version_dir(self._dir(key), version)
        if folder.is_dir():
            atomic_write(folder / "ROLLED_BACK", (reason + "\n").encode())

    def save_state(self, key: VariantKey, state: dict) -> None:
        atomic_write(self._dir(key) / STATE_FILE, encode_state(state))

    def load_state(self, key: VariantKey) -> dict | None:
        path = self._dir(key) / STATE_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            legacy = self._dir(key) / LEGACY_STATE_FILE
            if legacy.exists():  # never unpickled: whoever can write the store would run code here
                raise ModelUnavailable(f"learner checkpoint {legacy} is a pickle (torch.save) file, which can run code "
                                       "when loaded; refusing it - delete it to start over from the serving version") from None
            return None
        except OSError as exc:
            raise ModelUnavailable(f"learner checkpoint {path} is unreadable ({exc})") from None
        return decode_state(data, str(path))

    def dead_letter(self, entry_id: str, payload: bytes, reason: str) -> None:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", entry_id)[-80:]
        text = payload.decode("utf-8", "replace") if isinstance(payload, (bytes, bytearray)) else str(payload)
        record = {"entry_id": entry_id, "reason": reason, "time": time.time(), "payload": text}
        atomic_write(self.root / DEAD_LETTERS / f"{time.time_ns()}-{safe}.json", json.dumps(record).encode())

    def dead_letters(self) -> list[dict]:
        """The dead-lettered records, oldest first (operators, tests)."""
        folder = self.root / DEAD_LETTERS
        if not folder.is_dir():
            return []
        return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]

    def _prune(self, key: VariantKey) -> None:
        if self.keep_versions <= 0:
            return
        serving = self.serving(key)
        old = self.versions(key)[: -self.keep_versions]
        for version in old:
            if version != serving:
                shutil.rmtree(self._version_dir(self._dir(key), version), ignore_errors=True)


def _os_error(path: Path, exc: OSError) -> Exception:
    """A full disk as its one clear error; other OS errors as they are."""
    return disk_full(path, exc) if exc.errno in (errno.ENOSPC, errno.EDQUOT) else exc


StoreFactory = Callable[[str], ModelStore]


def _directory_store(uri: str) -> ModelStore:
    parts = urlsplit(uri)
    return DirectoryModelStore(parts.path if parts.scheme == "file" else uri)


def open_model_store(uri: str | Path, schemes: dict[str, StoreFactory] | None = None) -> ModelStore:
    """The store a URI names: a folder path or ``file:///path``; ``schemes`` adds others
    (e.g. ``{"s3": make_s3_store}``)."""
    uri = str(uri)
    factories: dict[str, StoreFactory] = {"": _directory_store, "file": _directory_store, **(schemes or {})}
    scheme = urlsplit(uri).scheme if "://" in uri else ""
    factory = factories.get(scheme)
    if factory is None:
        raise NotFound(f"no model store for {scheme}:// URIs; use a folder path or file:///path")
    return factory(uri)
