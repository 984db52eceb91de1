"""ShardedTransport: one AsyncClient, connections split over small pools, slots released on close."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from composer_replication.teacher_replay.transport import ShardedTransport


def test_shards_and_validation():
    assert ShardedTransport(32, shard_size=4).num_shards == 8
    assert ShardedTransport(5, shard_size=4).num_shards == 2
    assert ShardedTransport(1).num_shards == 1
    with pytest.raises(ValueError, match="must be >= 1"):
        ShardedTransport(0)


def test_requests_spread_over_shards_and_release_their_slots(fake_server):
    from replay_helpers import SECRET

    fake_server.cfg.latency_s = 0.05
    transport = ShardedTransport(8, shard_size=2)
    peak = []

    async def go():
        sem = asyncio.Semaphore(8)  # as many in flight as connections (the replay's semaphores do this)
        async with httpx.AsyncClient(transport=transport) as client:

            async def one(i: int) -> int:
                async with sem:
                    return await post(client, i)

            async def post(client: httpx.AsyncClient, i: int) -> int:
                r = await client.post(
                    fake_server.base_url + "/chat/completions",
                    json={"model": "a/one", "messages": [{"role": "user", "content": str(i)}]},
                    headers={"Authorization": f"Bearer {SECRET}"},
                )
                peak.append(list(transport._busy))
                return r.status_code

            return await asyncio.gather(*[one(i) for i in range(16)])

    assert asyncio.run(go()) == [200] * 16
    assert transport._busy == [0, 0, 0, 0]  # every slot released once the bodies were read
    assert max(max(b) for b in peak) <= 2 and any(sum(1 for x in b if x) >= 2 for b in peak)
