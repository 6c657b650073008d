"""API keys -> tenants: who a served request is, for the gRPC and the HTTP API alike.

A key file (YAML or JSON) holds only SHA-256 hashes of the keys, never a key itself:

    # specpool API keys (specpool keys create --tenant acme --file keys.yaml)
    keys:
      - tenant: acme
        sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
        name: acme-ci          # optional label, for people
      - tenant: ops
        sha256: ...
        role: admin            # may act for any tenant (operations that span tenants)

The router reads it from ``api_keys_file`` in its args (``specpool serve --api-keys FILE``; on
Kubernetes a Secret mounted as a file) or, when no file is named, from the environment variable
``SPECPOOL_API_KEYS`` holding the same document inline (a Secret exposed through ``secretKeyRef``).
No keys configured: the API is open and a request's tenant is the one it names (the embedded mode
and a private loopback server need nothing more).

With keys, a request's tenant is its key's: no key or an unknown one is UNAUTHENTICATED; a key that
names another tenant in the request is PERMISSION_DENIED unless its role is admin. Keys are
generated with 256 bits of randomness (``new_key``), so an unsalted SHA-256 is enough to make a
leaked key file useless (a salt or a slow hash protects guessable passwords, which these are not),
and looking a hash up in a dict leaks nothing useful through timing.

Pure (standard library, PyYAML, the tenant rule of the session store): the CLI checks a key file before anything starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from specpool.core.defaults import DEFAULT_TENANT
from specpool.core.errors import InvalidArgument, NotFound, PermissionDenied, Unauthenticated
from specpool.router.session_store import TENANT_PATTERN

ENV_KEYS = "SPECPOOL_API_KEYS"  # the key document inline (YAML or JSON), when no file is named
KEY_PREFIX = "sp-"
ROLES = ("user", "admin")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def new_key() -> str:
    """A fresh API key: ``sp-`` and 43 URL-safe characters (32 random bytes)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who a request is: its key's tenant, and whether that key may act for every tenant."""

    tenant: str
    admin: bool = False
    name: str = ""


@dataclass(frozen=True)
class KeyEntry:
    tenant: str
    sha256: str
    role: str = "user"
    name: str = ""

    def as_dict(self) -> dict:
        out = {"tenant": self.tenant, "sha256": self.sha256}
        if self.role != "user":
            out["role"] = self.role
        if self.name:
            out["name"] = self.name
        return out


class ApiKeys:
    """The key-to-tenant map. ``ApiKeys.open()`` (no keys) lets every request through."""

    def __init__(self, entries: Iterable[KeyEntry] = ()):
        self.entries = tuple(entries)
        self._by_hash = {e.sha256: e for e in self.entries}

    @classmethod
    def open(cls) -> "ApiKeys":
        return cls(())

    @property
    def enabled(self) -> bool:
        return bool(self._by_hash)

    @property
    def tenants(self) -> set[str]:
        return {e.tenant for e in self.entries}

    def principal(self, key: str | None) -> Principal | None:
        """The key's principal; None when keys are off. Raises Unauthenticated for a missing or
        unknown key."""
        if not self.enabled:
            return None
        if not key:
            raise Unauthenticated("this server needs an API key: send 'authorization: Bearer KEY' "
                                  "(gRPC metadata or HTTP header)")
        entry = self._by_hash.get(hash_key(key))
        if entry is None:
            raise Unauthenticated("unknown API key")
        return Principal(entry.tenant, entry.role == "admin", entry.name)

    def tenant_for(self, key: str | None, requested: str = "") -> str:
        """The tenant a request runs as: with keys, its key's (an admin may name any); without,
        the one it names (or the default)."""
        principal = self.principal(key)
        if principal is None:
            return requested or DEFAULT_TENANT
        if not requested or requested == principal.tenant:
            return principal.tenant
        if principal.admin:
            return requested
        raise PermissionDenied(f"this API key belongs to tenant {principal.tenant!r} and may not act for tenant {requested!r}")

    def require_admin(self, key: str | None, what: str) -> None:
        """Operations that span tenants: an admin key (anything goes while keys are off)."""
        principal = self.principal(key)
        if principal is not None and not principal.admin:
            raise PermissionDenied(f"{what} needs an admin API key")


def bearer_token(value: str | None) -> str | None:
    """The key in an ``authorization`` value: ``Bearer KEY`` (case-insensitive scheme); None if absent."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("the authorization header must be 'Bearer KEY'")
    return token.strip()


# -- key documents ---------------------------------------------------------------------------------
def parse_keys(document: Any, source: str) -> ApiKeys:
    """Check a key document ({keys: [{tenant, sha256, role?, name?}, ...]}); one line per mistake."""
    if not isinstance(document, Mapping) or not isinstance(document.get("keys"), list):
        raise InvalidArgument(f"{source}: expected a mapping with a list 'keys' of {{tenant, sha256, role}}")
    entries: list[KeyEntry] = []
    for i, raw in enumerate(document["keys"]):
        where = f"{source}: keys[{i}]"
        if not isinstance(raw, Mapping):
            raise InvalidArgument(f"{where} must be a mapping {{tenant, sha256, role}}")
        unknown = set(raw) - {"tenant", "sha256", "role", "name"}
        if unknown:
            raise InvalidArgument(f"{where} has unknown fields {sorted(unknown)} (known: tenant, sha256, role, name)")
        tenant, digest = raw.get("tenant"), raw.get("sha256")
        if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant):
            raise InvalidArgument(f"{where}: tenant must be 1-64 characters from A-Z a-z 0-9 _ . -, got {tenant!r}")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise InvalidArgument(f"{where}: sha256 must be 64 lowercase hex digits (the key's hash, never the key), got {str(digest)[:20]!r}")
        role = raw.get("role", "user")
        if role not in ROLES:
            raise InvalidArgument(f"{where}: role must be user or admin, got {role!r}")
        name = raw.get("name", "")
        if not isinstance(name, str):
            raise InvalidArgument(f"{where}: name must be a string, got {name!r}")
        entries.append(KeyEntry(tenant, digest, role, name))
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        if entry.sha256 in seen:
            raise InvalidArgument(f"{source}: keys[{seen[entry.sha256]}] and keys[{i}] are the same key")
        seen[entry.sha256] = i
    if not entries:
        raise InvalidArgument(f"{source}: 'keys' is empty; remove the key file to serve without keys")
    return ApiKeys(entries)


def _load_document(text: str, source: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"{source}: not valid YAML or JSON ({str(exc).splitlines()[0]})") from None


def load_keys_file(path: str | os.PathLike) -> ApiKeys:
    path = Path(path)
    if not path.is_file():
        raise NotFound(f"API key file {path} does not exist (create one: specpool keys create --tenant NAME --file {path})")
    return parse_keys(_load_document(path.read_text(encoding="utf-8"), str(path)), str(path))


def load_api_keys(path: str | None, environ: Mapping[str, str] | None = None) -> ApiKeys:
    """The server's keys: the file at ``path``; else the ``SPECPOOL_API_KEYS`` document; else open."""
    if path:
        return load_keys_file(path)
    environ = os.environ if environ is None else environ
    inline = environ.get(ENV_KEYS, "").strip()
    if inline:
        return parse_keys(_load_document(inline, f"${ENV_KEYS}"), f"${ENV_KEYS}")
    return ApiKeys.open()


def add_key(path: str | os.PathLike, tenant: str, role: str = "user", name: str = "") -> str:
    """Make a new key for ``tenant``, add its hash to the key file (created if missing; written
    atomically) and return the key: the only time it is ever shown."""
    path = Path(path)
    existing = list(load_keys_file(path).entries) if path.exists() else []
    key = new_key()
    entry = KeyEntry(tenant, hash_key(key), role, name)
    parse_keys({"keys": [e.as_dict() for e in existing] + [entry.as_dict()]}, str(path))  # same checks as loading
    document = {"keys": [e.as_dict() for e in existing] + [entry.as_dict()]}
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("# specpool API keys: SHA-256 hashes only (specpool keys create ...)\n")
        f.write(json.dumps(document, indent=2) + "\n")  # JSON is YAML too
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return key


__all__ = ["ApiKeys", "ENV_KEYS", "KeyEntry", "Principal", "add_key", "bearer_token", "hash_key", "load_api_keys",
           "load_keys_file", "new_key", "parse_keys"]
