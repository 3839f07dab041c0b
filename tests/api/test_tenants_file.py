"""The tenants file, checked at start (mistakes refused with their line), key lookup, and the quota
ledger on its own: rolling minute, Retry-After, what a cancelled request counts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from opentgi.api.tenants.ledger import TenantLedger, TenantQuotaError
from opentgi.api.tenants.table import TenantFileError, TenantTable, load_tenant_file, parse_tenants
from opentgi.cli import build_parser, settings_from

GOOD = """\
tenants:
  - name: alpha
    keys: [sk-alpha-1, sk-alpha-2]
    weight: 1.5
  - name: beta
    keys:
      - sk-beta
    tokens_per_minute: 600
    max_concurrent_requests: 4
  - name: ops
    keys: [sk-ops]
    admin: true
"""


def test_a_good_file_and_lookup_by_key():
    table = parse_tenants(GOOD)
    assert [t.name for t in table.tenants] == ["alpha", "beta", "ops"]
    alpha, beta, ops = table.tenants
    assert (alpha.weight, alpha.tokens_per_minute, alpha.admin) == (1.5, None, False)
    assert (beta.weight, beta.tokens_per_minute, beta.max_concurrent_requests) == (1.0, 600, 4)
    assert ops.admin
    assert table.find(b"sk-alpha-2") is alpha and table.find(b"sk-beta") is beta
    assert table.find(b"sk-alpha") is None and table.find(b"") is None
    assert "sk-alpha" not in repr(alpha)  # keys never reach a log line


def test_json_is_read_too(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [{"name": "a", "keys": ["k1"], "weight": 3}]}))
    assert load_tenant_file(str(path)).tenants[0].weight == 3.0


@pytest.mark.parametrize("text, message", [
    (GOOD.replace("[sk-ops]", "[sk-beta]"), "line 11: duplicate key (tenant 'ops'; also on line 7)"),
    (GOOD.replace("    weight: 1.5\n", "    weight: 1.5\n    wieght: 2\n"), "line 5: unknown field 'wieght'"),
    (GOOD.replace("weight: 1.5", "weight: 0"), "line 4: `weight` must be a number above 0, got 0"),
    (GOOD.replace("weight: 1.5", "weight: lots"), "line 4: `weight` must be a number above 0, got 'lots'"),
    (GOOD.replace("600", "-5"), "line 8: `tokens_per_minute` must be a whole number of 1 or more, got -5"),
    (GOOD.replace("max_concurrent_requests: 4", "max_concurrent_requests: 2.5"),
     "line 9: `max_concurrent_requests` must be a whole number of 1 or more, got 2.5"),
    (GOOD.replace("admin: true", "admin: yes please"), "line 12: `admin` must be true or false"),
    (GOOD.replace("name: ops", "name: alpha"), "line 10: duplicate tenant name 'alpha'"),
    (GOOD.replace("    keys: [sk-ops]\n", ""), "line 10: a tenant needs `keys`"),
    (GOOD.replace("[sk-ops]", "[]"), "line 11: `keys` must be a non-empty list of strings"),
    (GOOD.replace("    weight: 1.5\n", "    weight: 1.5\n    weight: 2\n"), "line 5: field 'weight' given twice"),
    ("tenant:\n  - name: a\n", "line 1: unknown field 'tenant' (expected `tenants`)"),
    ("tenants: [\n", "not YAML or JSON"),
])
def test_mistakes_are_refused_with_their_line(text, message):
    with pytest.raises(TenantFileError) as caught:
        parse_tenants(text, "tenants.yaml")
    assert message in str(caught.value)
    assert str(caught.value).startswith("tenants.yaml")


def test_the_cli_checks_the_file_at_start(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(GOOD.replace("weight: 1.5", "weight: -1"))
    parser = build_parser()
    with pytest.raises(SystemExit, match=r"--tenants: .*tenants.yaml, line 4: `weight` must be a number above 0"):
        settings_from(parser.parse_args(["serve", "--tenants", str(path)]), {})
    path.write_text(GOOD)
    assert settings_from(parser.parse_args(["serve", "--tenants", str(path)]), {}).tenants_file == str(path)
    with pytest.raises(SystemExit, match="--tenants replaces --api-key"):
        settings_from(parser.parse_args(["serve", "--tenants", str(path), "--api-key", "k"]), {})


class Clock:
    now = 100.0

    def __call__(self):
        return self.now


def request(prompt_tokens: int):
    return SimpleNamespace(num_prompt_tokens=prompt_tokens)


def test_tokens_per_minute_rolls_and_a_cancelled_request_counts_what_it_used():
    clock = Clock()
    table = TenantTable([*parse_tenants(GOOD).tenants])
    beta = table.by_name["beta"]
    ledger = TenantLedger(table, clock=clock)
    done = SimpleNamespace(final=SimpleNamespace(generated_tokens=290,
                                                 timings=SimpleNamespace(queued_at=0.0, scheduled_at=None)))
    ledger.admit(beta).settle([request(10)], [done])  # 300 tokens at t=100
    clock.now = 130.0
    cancelled = SimpleNamespace(final=None, num_generated_tokens=250)  # cancelled after 250 tokens
    lease = ledger.admit(beta)
    lease.settle([request(50)], [cancelled])
    lease.settle([request(50)], [cancelled])  # settling twice counts once
    assert ledger.usage["beta"].window_tokens == 600
    with pytest.raises(TenantQuotaError) as caught:
        ledger.admit(beta)
    assert caught.value.status == 429 and caught.value.headers == {"Retry-After": "30"}  # t=100's tokens go at 160
    clock.now = 160.0
    ledger.admit(beta).settle([request(1)], [])  # refused on submit: no handle, nothing used
    snapshot = ledger.snapshot()["beta"]
    assert (snapshot["requests"], snapshot["prompt_tokens"], snapshot["generated_tokens"]) == (3, 60, 540)
    assert snapshot["tokens_last_minute"] == 300 and snapshot["in_flight"] == 0
    assert snapshot["rejected"] == {"tokens_per_minute": 1, "max_concurrent_requests": 0}
