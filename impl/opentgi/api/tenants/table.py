"""Who may call the server: the tenants of `--tenants FILE`, or the one tenant of `--api-key`.

The file (YAML, or JSON, which YAML reads too) is checked whole before the server starts; every
mistake is refused with its line:

    tenants:
      - name: alpha
        keys: [sk-alpha-1, sk-alpha-2]
        weight: 2                      # share of the batch (default 1)
        tokens_per_minute: 600         # prompt + generated tokens in any rolling 60 s (default: no limit)
        max_concurrent_requests: 4     # requests in flight (default: no limit)
      - name: ops
        keys: [sk-ops]
        admin: true                    # may call /v1/usage and /metrics

`--api-key` / `--api-key-file` make one admin tenant, `default`, holding every key. A key is looked
up by comparing it with every key of every tenant in constant time (`hmac.compare_digest`, all of
them whichever matches).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field

import yaml

FIELDS = frozenset({"name", "keys", "weight", "tokens_per_minute", "max_concurrent_requests", "admin"})
DEFAULT_TENANT = "default"


class TenantFileError(ValueError):
    """The tenants file is unreadable or wrong; the message names the file and the line."""


@dataclass(frozen=True)
class Tenant:
    name: str
    keys: tuple[str, ...] = field(repr=False)  # never logged
    weight: float = 1.0
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    admin: bool = False


class TenantTable:
    """The tenants of a server, found by key. `replace` swaps in another file's tenants at once (a
    lookup in progress finishes on the old ones)."""

    def __init__(self, tenants: Iterable[Tenant]):
        listed = list(tenants)
        self._state = (listed, {t.name: t for t in listed}, [(k.encode(), t) for t in listed for k in t.keys])

    @property
    def tenants(self) -> list[Tenant]:
        return self._state[0]

    @property
    def by_name(self) -> dict[str, Tenant]:
        return self._state[1]

    def replace(self, other: TenantTable) -> None:
        self._state = other._state  # one assignment: never half of each

    @classmethod
    def from_keys(cls, keys: Iterable[str]) -> TenantTable:
        """`--api-key` / `--api-key-file`: one admin tenant holding every key."""
        return cls([Tenant(DEFAULT_TENANT, tuple(keys), admin=True)])

    def find(self, token: bytes) -> Tenant | None:
        """The tenant holding `token`; every key is compared, in constant time each."""
        found = None
        for key, tenant in self._state[2]:
            if hmac.compare_digest(token, key):
                found = tenant
        return found


def tenant_table_for(settings, api_keys: list[str]) -> TenantTable | None:
    """The server's tenants: `--tenants FILE`, else one admin tenant of `--api-key`'s keys, else
    None (a server without keys: anyone may call it, no quotas)."""
    if settings.tenants_file:
        return load_tenant_file(settings.tenants_file)
    return TenantTable.from_keys(api_keys) if api_keys else None


def load_tenant_file(path: str) -> TenantTable:
    """The tenants of a YAML or JSON file; TenantFileError, with the line, for any mistake."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise TenantFileError(f"cannot read the tenants file {path!r}: {exc}") from exc
    return parse_tenants(text, path)


def parse_tenants(text: str, source: str = "<tenants>") -> TenantTable:
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
    except yaml.YAMLError as exc:
        raise TenantFileError(f"{source}: not YAML or JSON: {exc}") from exc
    finally:
        loader.dispose()

    def fail(node, message: str):
        raise TenantFileError(f"{source}, line {node.start_mark.line + 1}: {message}")

    if not isinstance(root, yaml.MappingNode):
        raise TenantFileError(f"{source}: expected a mapping with a `tenants` list")
    top = _mapping(root, fail)
    unknown = [k for k in top if k != "tenants"]
    if unknown:
        fail(top[unknown[0]][0], f"unknown field {unknown[0]!r} (expected `tenants`)")
    if "tenants" not in top:
        fail(root, "no `tenants` list")
    _, listed = top["tenants"]
    if not isinstance(listed, yaml.SequenceNode) or not listed.value:
        fail(listed, "`tenants` must be a non-empty list")
    tenants: list[Tenant] = []
    key_lines: dict[str, int] = {}
    for item in listed.value:
        tenant = _tenant(item, fail, loader)
        if tenant.name in {t.name for t in tenants}:
            fail(item, f"duplicate tenant name {tenant.name!r}")
        keys_node = _mapping(item, fail)["keys"][1]
        for key, key_node in zip(tenant.keys, keys_node.value):
            if key in key_lines:
                fail(key_node, f"duplicate key (tenant {tenant.name!r}; also on line {key_lines[key]})")
            key_lines[key] = key_node.start_mark.line + 1
        tenants.append(tenant)
    return TenantTable(tenants)


def _mapping(node, fail) -> dict[str, tuple]:
    """A mapping node's fields: name -> (key node, value node); a repeated field is refused."""
    if not isinstance(node, yaml.MappingNode):
        fail(node, "expected a mapping")
    out: dict[str, tuple] = {}
    for key_node, value_node in node.value:
        name = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
        if not isinstance(name, str):
            fail(key_node, "a field name must be a string")
        if name in out:
            fail(key_node, f"field {name!r} given twice")
        out[name] = (key_node, value_node)
    return out


def _tenant(node, fail, loader: yaml.SafeLoader) -> Tenant:
    fields = _mapping(node, fail)
    for name, (key_node, _) in fields.items():
        if name not in FIELDS:
            fail(key_node, f"unknown field {name!r} (expected one of {', '.join(sorted(FIELDS))})")
    for required in ("name", "keys"):
        if required not in fields:
            fail(node, f"a tenant needs `{required}`")

    def value(name: str):
        return loader.construct_object(fields[name][1], deep=True)

    name = value("name")
    if not isinstance(name, str) or not name.strip() or not name.isprintable():
        fail(fields["name"][1], "`name` must be a non-empty string")
    keys_node = fields["keys"][1]
    keys = value("keys")
    if not isinstance(keys, list) or not keys:
        fail(keys_node, "`keys` must be a non-empty list of strings")
    for key, key_node in zip(keys, keys_node.value):
        if not isinstance(key, str) or not key.strip() or key != key.strip():
            fail(key_node, "a key must be a non-empty string without surrounding spaces")
    options: dict = {}
    if "weight" in fields:
        weight = value("weight")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < float("inf"):
            fail(fields["weight"][1], f"`weight` must be a number above 0, got {weight!r}")
        options["weight"] = float(weight)
    for limit in ("tokens_per_minute", "max_concurrent_requests"):
        if limit in fields:
            number = value(limit)
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                fail(fields[limit][1], f"`{limit}` must be a whole number of 1 or more, got {number!r}")
            options[limit] = number
    if "admin" in fields:
        admin = value("admin")
        if not isinstance(admin, bool):
            fail(fields["admin"][1], f"`admin` must be true or false, got {admin!r}")
        options["admin"] = admin
    return Tenant(name, tuple(keys), **options)


_current: ContextVar[Tenant | None] = ContextVar("opentgi_tenant", default=None)


def current() -> Tenant | None:
    """The tenant of the request being served (None on a server without keys)."""
    return _current.get()


def bind(tenant: Tenant | None):
    """Make `tenant` current (returns the token for `unbind`); the auth middleware does this."""
    return _current.set(tenant)


def unbind(token) -> None:
    _current.reset(token)
