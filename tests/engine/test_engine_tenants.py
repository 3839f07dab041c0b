"""Tenants through the real engine loop on the tiny Llama: a tenant arriving behind another's flood
is served next, and a cancelled request reports the tokens it got (what its tenant's quota counts)."""

from __future__ import annotations

import asyncio

from opentgi.engine.request import GenerationRequest, SamplingParams, StoppingParams
from tests.helpers.engine import running


def request(tenant: str | None, max_new_tokens: int = 6) -> GenerationRequest:
    return GenerationRequest([1, 2, 3, 4], SamplingParams(),
                             StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=True), tenant=tenant)


async def finishing_order(engine, requests: list[GenerationRequest]) -> list[str]:
    handles = [await engine.submit(r) for r in requests]
    order: list[str] = []

    async def wait(handle):
        await handle.result()
        order.append(handle.request_id)

    await asyncio.gather(*(wait(h) for h in handles))
    return order


async def test_a_late_tenant_is_served_before_the_flood(llama):
    async with running(llama, max_batch_size=1) as engine:
        flood = [request("alpha") for _ in range(6)]
        late = request("beta")
        order = await finishing_order(engine, [*flood, late])
        assert order.index(late.request_id) <= 1  # first-come would finish it last
        assert [i for i in order if i != late.request_id] == [r.request_id for r in flood]
        # without tenants: first-come
        plain = [request(None) for _ in range(4)]
        assert await finishing_order(engine, plain) == [r.request_id for r in plain]


async def test_a_cancelled_request_reports_what_it_generated(llama):
    async with running(llama) as engine:
        handle = await engine.submit(request("alpha", max_new_tokens=40))
        received = 0
        async for _event in handle:
            received += 1
            if received == 3:
                break
        handle.cancel()
        assert 3 <= handle.num_generated_tokens < 40
