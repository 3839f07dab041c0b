"""One server, many tenants (`--tenants FILE`, or the one tenant of `--api-key`).

- `table`: the tenants, their keys, weights and quotas, read and checked from the file; the
  tenant of the request being served (bound by the auth middleware, api/server/auth.py);
- `ledger`: per-tenant quotas (429 with Retry-After) and usage, with the per-tenant metrics;
- `handlers`: `GET /v1/usage` (openapi/tenants.yaml, admin only).

The engine learns a request's tenant and weight from the engine request (`GenerationRequest.tenant`,
`.tenant_weight`) and shares the batch by them (engine/scheduling/fair_share.py).
"""
