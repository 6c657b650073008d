"""API keys -> tenants (specpool/services/auth.py) and `specpool keys`."""

from __future__ import annotations

import json
import os
import stat

import pytest

from specpool.core.errors import InvalidArgument, NotFound, PermissionDenied, Unauthenticated
from specpool.services.auth import (ENV_KEYS, ApiKeys, add_key, bearer_token, hash_key, load_api_keys, load_keys_file,
                                    new_key, parse_keys)


def keys_for(**tenants) -> tuple[ApiKeys, dict[str, str]]:
    """Keys for tenant=role pairs; returns the map and {tenant: key}."""
    made = {tenant: new_key() for tenant in tenants}
    doc = {"keys": [{"tenant": t, "sha256": hash_key(k), "role": tenants[t]} for t, k in made.items()]}
    return parse_keys(doc, "test"), made


def test_new_keys_are_long_random_and_distinct():
    keys = {new_key() for _ in range(200)}
    assert len(keys) == 200
    assert all(k.startswith("sp-") and len(k) == 46 for k in keys)


def test_without_keys_the_request_names_its_tenant():
    keys = ApiKeys.open()
    assert not keys.enabled
    assert keys.tenant_for(None, "") == "default"
    assert keys.tenant_for(None, "acme") == "acme"
    assert keys.tenant_for("anything", "acme") == "acme"  # a key sent to an open server is ignored
    keys.require_admin(None, "listing tenants")  # nothing to check


def test_a_key_is_its_tenant_and_may_not_act_for_another():
    keys, made = keys_for(acme="user", ops="admin")
    assert keys.tenant_for(made["acme"], "") == "acme"
    assert keys.tenant_for(made["acme"], "acme") == "acme"
    with pytest.raises(PermissionDenied, match="tenant 'acme' and may not act for tenant 'globex'"):
        keys.tenant_for(made["acme"], "globex")
    assert keys.tenant_for(made["ops"], "globex") == "globex"  # admin acts for anyone
    assert keys.tenant_for(made["ops"], "") == "ops"
    with pytest.raises(PermissionDenied, match="needs an admin"):
        keys.require_admin(made["acme"], "listing tenants")
    keys.require_admin(made["ops"], "listing tenants")


@pytest.mark.parametrize("key", [None, "", "sp-not-a-key", "Bearer"])
def test_missing_or_unknown_keys_are_unauthenticated(key):
    keys, _ = keys_for(acme="user")
    with pytest.raises(Unauthenticated):
        keys.tenant_for(key, "")


def test_bearer_token_parsing():
    assert bearer_token(None) is None and bearer_token("") is None
    assert bearer_token("Bearer sp-abc") == "sp-abc"
    assert bearer_token("bearer   sp-abc ") == "sp-abc"
    for bad in ("Basic dXNlcjpwYXNz", "sp-abc", "Bearer "):
        with pytest.raises(Unauthenticated, match="Bearer KEY"):
            bearer_token(bad)


@pytest.mark.parametrize("doc, fragment", [
    ([], "a list 'keys'"),
    ({"keys": "x"}, "a list 'keys'"),
    ({"keys": []}, "'keys' is empty"),
    ({"keys": ["x"]}, "keys[0] must be a mapping"),
    ({"keys": [{"tenant": "a", "sha256": "ab" * 32, "extra": 1}]}, "unknown fields ['extra']"),
    ({"keys": [{"tenant": "a b", "sha256": "ab" * 32}]}, "tenant must be"),
    ({"keys": [{"tenant": "a", "sha256": "sp-plaintext-key"}]}, "never the key"),
    ({"keys": [{"tenant": "a", "sha256": "AB" * 32}]}, "lowercase hex"),
    ({"keys": [{"tenant": "a", "sha256": "ab" * 32, "role": "root"}]}, "role must be user or admin"),
    ({"keys": [{"tenant": "a", "sha256": "ab" * 32}, {"tenant": "b", "sha256": "ab" * 32}]}, "the same key"),
])
def test_malformed_key_documents_are_one_clear_line(doc, fragment):
    with pytest.raises(InvalidArgument) as info:
        parse_keys(doc, "keys.yaml")
    message = str(info.value)
    assert fragment in message and message.startswith("keys.yaml") and "\n" not in message


def test_add_key_writes_hashes_only_atomically_and_private(tmp_path):
    path = tmp_path / "secrets" / "keys.yaml"
    first = add_key(path, "acme", name="ci")
    second = add_key(path, "ops", role="admin")
    text = path.read_text()
    assert first not in text and second not in text  # never the keys themselves
    assert hash_key(first) in text and hash_key(second) in text
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not list(path.parent.glob("*.tmp"))
    keys = load_keys_file(path)
    assert keys.tenant_for(first) == "acme" and keys.tenant_for(second, "x") == "x"
    with pytest.raises(InvalidArgument):
        add_key(path, "bad tenant")
    assert load_keys_file(path).tenants == {"acme", "ops"}  # a refused add leaves the file as it was


def test_keys_come_from_a_file_else_the_environment_else_none(tmp_path):
    key = new_key()
    doc = json.dumps({"keys": [{"tenant": "envtenant", "sha256": hash_key(key)}]})
    assert load_api_keys(None, environ={ENV_KEYS: doc}).tenant_for(key) == "envtenant"
    assert not load_api_keys(None, environ={}).enabled
    path = tmp_path / "k.yaml"
    add_key(path, "filetenant")
    assert load_api_keys(str(path), environ={ENV_KEYS: doc}).tenants == {"filetenant"}  # the file wins
    with pytest.raises(NotFound, match="does not exist"):
        load_api_keys(str(tmp_path / "missing.yaml"))
    with pytest.raises(InvalidArgument, match=r"\$SPECPOOL_API_KEYS"):
        load_api_keys(None, environ={ENV_KEYS: "keys: [oops"})


def test_cli_keys_create_and_list(cli, tmp_path):
    path = tmp_path / "keys.yaml"
    code, out, err = cli("keys", "create", "--tenant", "acme", "--file", str(path), "--name", "bot", target=None)
    assert code == 0, err
    key = out.strip()
    assert load_keys_file(path).tenant_for(key) == "acme" and "shown only now" in err
    code, out, _ = cli("keys", "list", "--file", str(path), target=None)
    assert code == 0 and out.startswith("acme\tuser\tbot\tsha256:") and key not in out
    code, _, err = cli("keys", "list", "--file", str(tmp_path / "nope.yaml"), target=None)
    assert code == 2 and err.count("\n") == 1 and "does not exist" in err


def test_serve_refuses_a_malformed_key_file_before_starting(cli, tmp_path):
    bad = tmp_path / "keys.yaml"
    bad.write_text("keys:\n  - {tenant: acme, sha256: not-a-hash}\n")
    code, _, err = cli("serve", "--api-keys", str(bad), "--print-config", target=None)
    assert code == 2 and "sha256 must be 64 lowercase hex digits" in err and err.count("\n") == 1
