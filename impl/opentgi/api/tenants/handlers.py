"""`GET /v1/usage` (openapi/tenants.yaml): per-tenant totals; the auth middleware lets only an
admin tenant's key through."""

from __future__ import annotations

from starlette.responses import JSONResponse

from opentgi.api import runtime
from opentgi.api.tenants.ledger import WINDOW_S
from opentgi.schemas import tenants as schema


async def usage() -> JSONResponse:
    ledger = runtime.state().tenants
    rows = ledger.snapshot() if ledger is not None else {}
    report = schema.UsageReport(window_seconds=int(WINDOW_S),
                                tenants=[schema.TenantUsage(name=name, **row) for name, row in rows.items()])
    return JSONResponse(report.model_dump(mode="json"))
