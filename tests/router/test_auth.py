"""API keys and tenant salts: parsing, lookup, the salts that separate tenants, and over HTTP
(uvicorn, the real app, scripted replicas): 401 / 403 before anything is queued, tenants'
equal prompts hash apart, a shared prefix group hashes together."""

from __future__ import annotations

import pytest
import requests

from router.auth import AuthArgs, AuthError, KeyTable, TenantArgs, parse_keys
from router.limits import RequestLimits
from tests.router.test_ingress import MODEL, Server, assert_clear_error

ENV = {"FAIRWAY_KEYS": "k-alice=alice, k-bob=bob,k-carol=carol"}


def table(**kw) -> KeyTable:
    args = AuthArgs(keys_env="FAIRWAY_KEYS", tenants={"alice": TenantArgs(prefix_groups=["handbook"]),
                                                      "bob": TenantArgs(prefix_groups=["handbook"])}, **kw)
    return KeyTable(args, environ=ENV)


def test_keys_from_a_file_and_the_environment(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# key tenant\nk-dave dave  # ops\n\nk-erin   erin\n")
    assert parse_keys(f.read_text(), " ") == {"k-dave": "dave", "k-erin": "erin"}
    keys = table(keys_file=str(f))
    assert len(keys) == 5 and keys.tenant_of("Bearer k-erin") == "erin" and keys.tenant_of("bearer k-bob") == "bob"
    with pytest.raises(ValueError, match="entry 2: expected") as e:
        parse_keys("a=b,secret-without-tenant", "=")
    assert "secret" not in str(e.value)  # an error never shows a key
    with pytest.raises(ValueError, match="FAIRWAY_NOPE is not set"):
        KeyTable(AuthArgs(keys_env="FAIRWAY_NOPE"), environ={})


def test_unknown_or_missing_keys_are_401_and_foreign_groups_403():
    keys = table()
    for header in (None, "", "Basic abc", "Bearer ", "Bearer k-alicee", "Bearer K-ALICE"):
        with pytest.raises(AuthError) as e:
            keys.principal(header, None)
        assert e.value.status == 401
    with pytest.raises(AuthError) as e:
        keys.principal("Bearer k-carol", "handbook")
    assert e.value.status == 403 and "handbook" in e.value.message


def test_salts_separate_tenants_nest_client_salts_and_join_a_shared_group():
    keys = table()
    alice, bob = keys.principal("Bearer k-alice", None), keys.principal("Bearer k-bob", None)
    assert (alice.tenant, alice.salt(None), alice.salt("x")) == ("alice", "tenant:alice", "tenant:alice|x")
    assert bob.salt("x") != alice.salt("x")  # a client salt never joins another tenant's cache
    ga, gb = keys.principal("Bearer k-alice", "handbook"), keys.principal("Bearer k-bob", "handbook")
    assert ga.salt(None) == gb.salt(None) == "group:handbook" and ga.tenant == "alice"
    off = KeyTable(AuthArgs())
    assert not off.enabled and off.principal(None, None).salt("c") == "c"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("auth") / "keys"
    keys.write_text("k-alice alice\nk-bob bob\nk-carol carol\n")
    auth = AuthArgs(keys_file=str(keys), tenants={"alice": TenantArgs(prefix_groups=["handbook"]),
                                                  "bob": TenantArgs(prefix_groups=["handbook"])})
    with Server(RequestLimits(), auth=auth) as srv:
        yield srv


def ask(server, key: str | None, group: str | None = None, **body) -> requests.Response:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if group:
        headers["X-Fairway-Prefix-Group"] = group
    payload = {"model": MODEL, "prompt": list(range(100, 164)), "max_tokens": 1, **body}
    return requests.post(server.url + "/v1/completions", json=payload, headers=headers, timeout=10)


def test_over_http_keys_are_checked_before_anything_is_queued(server):
    calls = len(server.replicas.calls)
    r = ask(server, None)
    assert_clear_error(r, 401, "missing API key")
    assert r.headers["www-authenticate"] == "Bearer"
    assert_clear_error(ask(server, "k-mallory"), 401, "invalid API key")
    assert_clear_error(ask(server, "k-carol", group="handbook"), 403, "not open to this tenant")
    big = requests.post(server.url + "/v1/completions", data=b"x" * 10_000_000, timeout=10)
    assert big.status_code == 401  # refused on its headers: the body was never read
    assert len(server.replicas.calls) == calls
    assert requests.get(server.url + "/health", timeout=10).status_code == 200  # liveness stays open
    assert requests.get(server.url + "/v1/models", timeout=10).status_code == 401


def test_over_http_tenants_hash_apart_and_a_group_hashes_together(server):
    def hashes(key: str, group: str | None = None, **body) -> tuple:
        assert ask(server, key, group, **body).status_code == 200
        call = server.replicas.calls[-1]
        return call.block_hashes, call.cache_salt, call.tenant

    a, b = hashes("k-alice"), hashes("k-bob")
    assert a[1:] == ("tenant:alice", "alice") and b[1:] == ("tenant:bob", "bob")
    assert len(a[0]) == 4 and set(a[0]).isdisjoint(b[0])  # equal prompts share no block
    assert hashes("k-alice")[0] == a[0]  # a tenant's repeat hits its own blocks
    assert hashes("k-alice", cache_salt="s1")[0] != a[0]
    ga, gb = hashes("k-alice", "handbook"), hashes("k-bob", "handbook")
    assert ga[0] == gb[0] and ga[1] == "group:handbook" and set(ga[0]).isdisjoint(a[0])
