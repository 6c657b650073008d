"""Durable files for the learner and the model store: every write of learning/ goes through here.

- ``atomic_write(path, data)``: a temporary file in the same folder, written and fsynced, renamed
  over ``path``, then the folder fsynced - after a crash or power loss a reader finds the old
  whole file or the new whole file, never a torn one (a rename alone can reach the disk before
  the data it names).
- ``write_synced`` / ``fsync_dir``: the same pieces for a folder that is renamed into place whole
  (a model version).
- Disk full (ENOSPC, EDQUOT) is one clear ``StoreUnavailable`` naming the path and the free space;
  the temporary is removed, so nothing half-written is left.
- ``encode_state`` / ``decode_state``: a learner checkpoint (nested dicts and lists of tensors,
  numbers, strings, bytes) as one safetensors file - the tensors as tensors, the rest as JSON in
  its header. Neither format can run code when loaded (a pickle can: ``torch.load`` of a file
  someone else could write runs whatever they put there), and a pickle is refused in one line.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors, save as save_tensors

from specpool.core.errors import ModelUnavailable, StoreUnavailable

STATE_FORMAT = "specpool-learner-state/1"
_FULL = (errno.ENOSPC, errno.EDQUOT)
_MAX_HEADER = 100_000_000  # safetensors' own limit on its JSON header


def _write_fully(fd: int, data: bytes) -> None:
    """os.write until all of ``data`` is written (the one place tests inject a full disk)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _free_bytes(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free:,} bytes free"
    except OSError:
        return "free space unknown"


def disk_full(path: Path, exc: OSError) -> StoreUnavailable:
    """The one error of a full disk (or quota), naming where and how much is left."""
    folder = path if path.is_dir() else path.parent
    return StoreUnavailable(f"no space left writing {path} ({os.strerror(exc.errno)}; {_free_bytes(folder)} on "
                            f"{folder}); free some space or move the model store - nothing was half-written")


def fsync_dir(folder: Path) -> None:
    """Make a rename (or a new name) in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Create ``path`` with ``data`` and fsync it (inside a folder that is renamed into place later)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            _write_fully(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        path.unlink(missing_ok=True)
        if exc.errno in _FULL:
            raise disk_full(path, exc) from None
        raise


def atomic_write(path: Path | str, data: bytes) -> None:
    """Replace ``path`` with ``data`` durably and atomically (see the module docstring)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    except OSError as exc:
        if exc.errno in _FULL:
            raise disk_full(path, exc) from None
        raise
    try:
        try:
            _write_fully(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno in _FULL:
            raise disk_full(path, exc) from None
        raise


# --- the checkpoint format ----------------------------------------------------------------------


def encode_state(state: dict) -> bytes:
    """``state`` as safetensors bytes: tensors by reference ``{"__tensor__": name}``, the structure
    as JSON in the header's metadata. Sparse tensors go as their indices and values."""
    tensors: dict[str, torch.Tensor] = {}

    def tensor_ref(t: torch.Tensor) -> str:
        name = f"t{len(tensors)}"
        tensors[name] = t.detach().cpu().contiguous().clone()  # clone: no shared storage (safetensors refuses it)
        return name

    def walk(value):
        if isinstance(value, torch.Tensor):
            if value.is_sparse:
                value = value.coalesce()
                return {"__sparse__": [tensor_ref(value.indices()), tensor_ref(value.values()), list(value.shape)]}
            return {"__tensor__": tensor_ref(value)}
        if isinstance(value, (bytes, bytearray)):
            return {"__bytes__": base64.b64encode(bytes(value)).decode()}
        if isinstance(value, dict):
            if any(not isinstance(k, str) for k in value):
                raise TypeError(f"checkpoint dict keys must be strings, got {list(value)[:3]}")
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"a learner checkpoint cannot hold a {type(value).__name__}")

    skeleton = walk(state)
    return save_tensors(tensors, metadata={"format": STATE_FORMAT, "state": json.dumps(skeleton)})


def _looks_pickled(data: bytes) -> bool:
    # torch.save writes a zip (PK..) around a pickle; older ones and pickle.dump start with PROTO (0x80).
    return data[:4] == b"PK\x03\x04" or data[:1] == b"\x80"


def decode_state(data: bytes, where: str) -> dict:
    """The state ``encode_state`` wrote; raises ModelUnavailable (one line) on anything else -
    a pickle is refused unread, so nothing in it runs."""
    try:
        (size,) = struct.unpack("<Q", data[:8])
        if not 0 < size <= min(_MAX_HEADER, len(data) - 8):
            raise ValueError("bad header size")
        header = json.loads(data[8:8 + size])
    except Exception:  # noqa: BLE001 - not safetensors; a pickle is named as such, never unpickled
        if _looks_pickled(data):
            raise ModelUnavailable(f"learner checkpoint {where} is a pickle (torch.save) file, which can run code when "
                                   "loaded; refusing it - delete it to start over from the serving version") from None
        header = None
    try:
        if not isinstance(header, dict):
            raise ValueError("not a safetensors file")
        metadata = header.get("__metadata__") or {}
        if metadata.get("format") != STATE_FORMAT:
            raise ValueError(f"format {metadata.get('format')!r}, not {STATE_FORMAT}")
        skeleton = json.loads(metadata["state"])
        tensors = load_tensors(data)
    except Exception as exc:  # noqa: BLE001 - any failure means the same: not a checkpoint we can read
        raise ModelUnavailable(f"learner checkpoint {where} is unreadable ({type(exc).__name__}: {exc}); "
                               "delete it to start over") from None

    def walk(value):
        if isinstance(value, dict):
            if value.keys() == {"__tensor__"}:
                return tensors[value["__tensor__"]]
            if value.keys() == {"__sparse__"}:
                indices, values, shape = value["__sparse__"]
                return torch.sparse_coo_tensor(tensors[indices], tensors[values], shape,
                                               check_invariants=True).coalesce()  # indices from a file: checked
            if value.keys() == {"__bytes__"}:
                return base64.b64decode(value["__bytes__"])
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    try:
        return walk(skeleton)
    except Exception as exc:  # noqa: BLE001 - a reference to a tensor the file lacks
        raise ModelUnavailable(f"learner checkpoint {where} is inconsistent ({type(exc).__name__}: {exc})") from None
