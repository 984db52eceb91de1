"""Real Monarch processes: the Reducer actor, and errors from an actor reaching the caller with its rank."""

from __future__ import annotations

import pytest
import torch

from meshes import ActorFailure, Reducer, install_fault_hook, wait

pytestmark = [pytest.mark.slow, pytest.mark.monarch]


@pytest.fixture(scope="module")
def reducer():
    from monarch.actor import this_host

    faults, restore = install_fault_hook()
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        yield procs.spawn("reducer", Reducer)
    finally:
        procs.stop().get(timeout=30)
        restore()


def test_reducer_averages_tensors_and_metrics(reducer):
    out = wait(reducer.average.call_one([{"w": torch.ones(3)}, {"w": 3 * torch.ones(3)}]), actor="reducer",
               timeout_s=120)
    assert torch.equal(out["w"], 2 * torch.ones(3))
    m = wait(reducer.aggregate_metrics.call_one([{"loss/total": 1.0, "replay/num_pairs": 1.0},
                                                  {"loss/total": 2.0, "replay/num_pairs": 2.0}]),
             actor="reducer", timeout_s=60)
    assert m == {"loss/total": 1.5, "replay/num_pairs": 3.0}  # counts (*/num_*) add up, the rest is averaged


def test_an_endpoint_error_names_actor_and_rank(reducer):
    with pytest.raises(ActorFailure, match=r"actor 'reducer' rank 0 raised an error during average: "
                                           r"ValueError: tensor 'w' has different shapes") as info:
        wait(reducer.average.call_one([{"w": torch.ones(2)}, {"w": torch.ones(3)}]), actor="reducer",
             timeout_s=60, what="average")
    assert info.value.rank == 0 and info.value.kind == "raised"
    # the actor survives its endpoint's error
    assert wait(reducer.aggregate_metrics.call_one([{"a": 1.0}]), actor="reducer", timeout_s=60) == {"a": 1.0}
