"""ObjectStoreAllReduce over file://, bare paths and memory://: averages, rounds, and every failure mode."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from tests_serverless_helpers import run_ranks

from composer_replication.diloco.serverless import (
    ObjectStoreAllReduce,
    RoundTimeoutError,
    StoreAccessError,
)
from composer_replication.diloco.serverless.store import (
    CorruptObjectError,
    decode_tensors,
    encode_tensors,
    write_atomic,
)

FAST = {"timeout_s": 5.0, "poll_interval_s": 0.01}


def contributions(r: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + r)
    return [torch.randn(3, 5, generator=g), torch.randn(7, generator=g, dtype=torch.float64)]


@pytest.fixture(params=["file", "bare", "memory"])
def store_uri(request, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/store"
    if request.param == "bare":
        return str(tmp_path / "store")
    return f"memory://ar-{uuid.uuid4().hex}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_agree_bit_for_bit_on_the_mean(store_uri: str, world_size: int) -> None:
    def rank_fn(r: int):
        ar = ObjectStoreAllReduce(store_uri, r, world_size, **FAST)
        history = []
        for step in range(3):  # three rounds, the second reduces two tensors at once
            ts = [t * (step + 1) for t in contributions(r)]
            if step == 1:
                ar.allreduce_tensors(ts, name="pair")
            else:
                ar.allreduce(ts[0], name="first")
            history.append([t.clone() for t in ts])
        return history, ar.round_id

    out = run_ranks(rank_fn, world_size)
    assert not any(isinstance(o, Exception) for o in out), out
    expected = [torch.stack([c[i] for c in map(contributions, range(world_size))]).mean(0) for i in range(2)]
    for history, round_id in out:
        assert round_id == 3
        torch.testing.assert_close(history[0][0], expected[0])
        torch.testing.assert_close(history[1][1], expected[1] * 2)
    for history, _ in out[1:]:  # bit-identical on every rank
        for step in range(3):
            assert torch.equal(history[step][0], out[0][0][step][0])


def test_world_size_1_is_a_passthrough_and_round_id_increments(tmp_path: Path) -> None:
    ar = ObjectStoreAllReduce(str(tmp_path / "solo"), 0, 1, round_id=5)
    t = torch.tensor([1.0, 2.0])
    assert ar.allreduce(t) is t and t.tolist() == [1.0, 2.0]
    assert ar.round_id == 6


def test_local_paths_are_created_at_construction(tmp_path: Path) -> None:
    ObjectStoreAllReduce(f"file://{tmp_path}/a/b", 0, 2)
    assert (tmp_path / "a" / "b").is_dir()


def test_bfloat16_and_scalars_round_trip() -> None:
    uri = f"memory://bf16-{uuid.uuid4().hex}"
    out = run_ranks(
        lambda r: ObjectStoreAllReduce(uri, r, 2, run_id="x", **FAST).allreduce_tensors(
            [torch.tensor(float(r), dtype=torch.bfloat16), torch.full((2, 2), 2.0 * r)]
        ),
        2,
    )
    for scalar, mat in out:
        assert scalar.dtype == torch.bfloat16 and scalar.item() == 0.5
        assert mat.tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_missing_rank_makes_every_rank_raise_naming_it(tmp_path: Path) -> None:
    uri = str(tmp_path / "s")

    def rank_fn(r: int):
        ar = ObjectStoreAllReduce(uri, r, 3, run_id="r1", timeout_s=0.5, poll_interval_s=0.01)
        ar.allreduce(torch.ones(1))  # round 0: everyone
        if r == 2:
            return "never wrote round 1"
        t = torch.ones(4) * r
        try:
            ar.allreduce(t)
        finally:
            assert t.tolist() == [float(r)] * 4  # left unchanged
        return "no error"

    out = run_ranks(rank_fn, 3)
    for r in (0, 1):
        assert isinstance(out[r], RoundTimeoutError), out
        assert isinstance(out[r], TimeoutError)
        assert (
            out[r].missing == [2] and "rank(s) [2]" in str(out[r]) and "dropped on every rank" in str(out[r])
        )


def test_a_rank_that_never_starts_fails_the_rendezvous_on_every_rank(tmp_path: Path) -> None:
    def rank_fn(r: int):
        if r == 2:
            return None
        return ObjectStoreAllReduce(str(tmp_path), r, 3, run_id="r", timeout_s=0.5, poll_interval_s=0.01).allreduce(
            torch.ones(1))

    out = run_ranks(rank_fn, 3)
    for r in (0, 1):
        assert isinstance(out[r], RoundTimeoutError) and out[r].missing == [2], out
        assert "rank(s) [2] did not join" in str(out[r]) and "dropped on every rank" in str(out[r])


def launched(uri: str, world_size: int = 2, **kwargs) -> list[ObjectStoreAllReduce]:
    """Ranks that have opened a launch together (round 0 done); the tests then drive round 1 by hand."""
    ranks = [ObjectStoreAllReduce(uri, r, world_size, **{**FAST, **kwargs}) for r in range(world_size)]
    out = run_ranks(lambda r: ranks[r].allreduce(torch.zeros(1)), world_size)
    assert not any(isinstance(o, Exception) for o in out), out
    return ranks


def test_a_late_rank_gets_the_same_abort(tmp_path: Path) -> None:
    """Rank 1 arrives after rank 0 aborted the round: it must drop it too, then both go on in step."""
    r0, r1 = launched(str(tmp_path / "s"), run_id="late")
    r0.timeout_s = 0.3
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\]"):
        r0.allreduce(torch.zeros(2))
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\]"):  # its own object came too late
        r1.allreduce(torch.ones(2))
    out = run_ranks(lambda r: [r0, r1][r].allreduce(torch.full((2,), float(r))), 2)
    assert [o.tolist() for o in out] == [[0.5, 0.5], [0.5, 0.5]]


def test_rendezvous_never_reads_files_of_an_earlier_run(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/shared"
    first = launched(uri)
    first[0].close()  # the run ended: the prefix is free again

    # Second run at the same URI: rank 1 starts first and sees the old launch.json, ready.json and round files;
    # it must wait for rank 0's fresh launch instead.
    def rank_fn(r: int):
        ar = ObjectStoreAllReduce(uri, r, 2, **FAST)
        if r == 0:
            time.sleep(0.5)
        return ar.allreduce(torch.full((2,), float(r))), ar.launch_id

    out = run_ranks(rank_fn, 2)
    assert [o[0].tolist() for o in out] == [[0.5, 0.5]] * 2
    assert out[0][1] == out[1][1] != first[0].launch_id
    assert len([p for p in (tmp_path / "shared" / "runs" / "auto").iterdir() if p.is_dir()]) == 2


def _plant(ar: ObjectStoreAllReduce, round_id: int, rank: int, data: bytes) -> None:
    write_atomic(ar._fs, ar._object(round_id, rank), data)


def test_stale_object_of_another_launch_is_never_read_as_current(tmp_path: Path) -> None:
    r0, r1 = launched(str(tmp_path / "s"), run_id="new")
    _plant(r1, 1, 1, encode_tensors([torch.full((2,), 99.0)], {"launch": "OLD", "round": 1, "rank": 1, "name": "t"}))
    r0.timeout_s = 0.3
    with pytest.raises(TimeoutError, match="stale") as info:
        r0.allreduce(torch.zeros(2))
    assert info.value.missing == [1]


def test_half_written_object_is_not_read_until_complete(tmp_path: Path) -> None:
    r0, r1 = launched(str(tmp_path / "s"), run_id="hw")
    full = encode_tensors([torch.full((1000,), 4.0)], {"launch": r1.launch_id, "round": 1, "rank": 1, "name": "t"})
    _plant(r1, 1, 1, full[: len(full) // 2])  # a non-atomic store shows half an object
    threading.Thread(target=lambda: (time.sleep(0.3), _plant(r1, 1, 1, full))).start()
    t = torch.zeros(1000)
    r0.allreduce(t, name="t")
    assert t.unique().tolist() == [2.0]


def test_half_written_object_that_never_completes_times_out_saying_so(tmp_path: Path) -> None:
    r0, r1 = launched(str(tmp_path / "s"), run_id="hw2")
    full = encode_tensors([torch.ones(10)], {"launch": r1.launch_id, "round": 1, "rank": 1, "name": "tensor"})
    _plant(r1, 1, 1, full[:-3])
    r0.timeout_s = 0.3
    with pytest.raises(TimeoutError, match="half-written"):
        r0.allreduce(torch.ones(10))


@pytest.mark.parametrize("header", [
    [1, 2], {"tensors": "x"}, {"tensors": [{"dtype": "int64", "shape": [1], "nbytes": 8}]},
    {"tensors": [{"dtype": "float32", "shape": [2], "nbytes": 4}]},
    {"tensors": [{"dtype": "float32", "shape": [-1], "nbytes": -4}]},
    {"tensors": [{"dtype": "float32", "shape": ["2"], "nbytes": 8}]},
    {"tensors": [{"dtype": "float32", "shape": [2**40, 2**40], "nbytes": 8}]},
    {"tensors": [{"dtype": "__class__", "shape": [1], "nbytes": 4}]},
])
def test_a_well_hashed_object_with_a_hostile_header_is_a_corrupt_missing_rank(tmp_path: Path, header) -> None:
    """The body's hash is right, the header is not a valid schema: a corrupt object, never a raw TypeError."""
    import hashlib
    import json
    import struct

    r0, r1 = launched(str(tmp_path / "s"), run_id="hostile")
    body = b"\0" * 8
    if isinstance(header, dict):
        header = {"launch": r1.launch_id, "round": 1, "rank": 1, "name": "tensor", "body_nbytes": len(body),
                  "sha256": hashlib.sha256(body).hexdigest(), **header}
    head = json.dumps(header).encode()
    _plant(r1, 1, 1, b"CRAR2\n" + struct.pack("<Q", len(head)) + head + body)
    with pytest.raises(CorruptObjectError):
        decode_tensors(r1._fs.cat_file(r1._object(1, 1)), {})
    r0.timeout_s = 0.3
    with pytest.raises(RoundTimeoutError) as info:
        r0.allreduce(torch.ones(2))
    assert info.value.missing == [1] and "rank 1:" in str(info.value)


def test_codec_rejects_truncation_corruption_and_other_rounds() -> None:
    data = encode_tensors([torch.arange(4.0)], {"launch": "a", "round": 3, "rank": 0, "name": "n"})
    header, (t,) = decode_tensors(data, {"launch": "a", "round": 3})
    assert header["name"] == "n" and t.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(CorruptObjectError, match="half-written"):
        decode_tensors(data[:-1], {})
    with pytest.raises(CorruptObjectError, match="SHA-256"):
        decode_tensors(data[:-1] + b"\x01", {})
    with pytest.raises(CorruptObjectError, match="stale"):
        decode_tensors(data, {"round": 2})


def test_ranks_that_disagree_on_shapes_all_raise_the_same_error() -> None:
    uri = f"memory://shape-{uuid.uuid4().hex}"
    out = run_ranks(
        lambda r: ObjectStoreAllReduce(uri, r, 2, run_id="s", **FAST).allreduce(torch.ones(2 + r)), 2
    )
    assert all(isinstance(o, ValueError) and "disagree" in str(o) for o in out), out


def test_missing_adapter_is_reported_at_first_allreduce_naming_the_package() -> None:
    ar = ObjectStoreAllReduce("gcs://bucket/run", 0, 2)  # constructing does not touch the store
    with pytest.raises(ImportError, match=r"pip install gcsfs"):
        ar.allreduce(torch.ones(1))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"uri": ""}, "uri"),
        ({"rank": 2}, "rank"),
        ({"world_size": 0}, "world_size"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"round_id": -1}, "round_id"),
        ({"run_id": "a/b"}, "run_id"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict, match: str, tmp_path: Path) -> None:
    args = {"uri": str(tmp_path), "rank": 0, "world_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        ObjectStoreAllReduce(args.pop("uri"), args.pop("rank"), args.pop("world_size"), **args)


def test_integer_tensors_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="floating"):
        ObjectStoreAllReduce(str(tmp_path), 0, 2).allreduce(torch.ones(2, dtype=torch.int64))


def test_elastic_membership_commits_without_a_missing_rank_and_stops_waiting_for_it(tmp_path: Path) -> None:
    ranks = launched(str(tmp_path / "s"), 3, run_id="el", timeout_s=1.0, min_world_size=2)

    def rank_fn(r: int):
        if r == 2:
            return None  # slow: misses rounds 1 and 2
        ar = ranks[r]
        first = ar.allreduce(torch.full((2,), float(r))).clone()
        t0 = time.monotonic()
        second = ar.allreduce(torch.full((2,), 10.0 * r)).clone()
        return first, second, time.monotonic() - t0, ar.last_participants

    out = run_ranks(rank_fn, 3)
    for first, second, seconds, participants in out[:2]:
        assert first.tolist() == [0.5, 0.5] and second.tolist() == [5.0, 5.0]
        assert participants == [0, 1]
        assert seconds < 0.9  # the second round does not wait for rank 2 again
    t = torch.full((2,), 99.0)
    ranks[2].allreduce(t)  # round 1 was committed without it: it adopts the same mean
    assert t.tolist() == [0.5, 0.5]


def test_elastic_membership_below_the_minimum_aborts(tmp_path: Path) -> None:
    ar = ObjectStoreAllReduce(
        str(tmp_path), 0, 3, run_id="m", timeout_s=0.2, poll_interval_s=0.01, min_world_size=2
    )
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1, 2\] did not join"):
        ar.allreduce(torch.ones(1))
    with pytest.raises(ValueError, match="min_world_size"):
        ObjectStoreAllReduce(str(tmp_path), 0, 3, min_world_size=4)


def test_refused_write_is_an_access_error_at_first_allreduce(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import composer_replication.diloco.serverless.rendezvous as rendezvous_module

    def refuse(fs, path, data):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(rendezvous_module, "write_atomic", refuse)
    ar = ObjectStoreAllReduce(str(tmp_path / "ro"), 0, 2, run_id="r", timeout_s=1)
    with pytest.raises(StoreAccessError, match="make the folder writable"):
        ar.allreduce(torch.ones(1))


@pytest.mark.parametrize("elastic", [True, False])
def test_a_nonfinite_object_counts_as_missing_on_every_rank(tmp_path: Path, elastic: bool) -> None:
    """Rank 1 sends a NaN and an inf: elastic, every rank (rank 1 too) gets the mean of ranks 0 and 2; strict,
    every rank raises the same error naming rank 1."""
    ranks = launched(str(tmp_path / "s"), 3, run_id="nf", min_world_size=2 if elastic else None)
    values = {0: [0.0, 1.0], 1: [float("nan"), float("inf")], 2: [2.0, 3.0]}
    out = run_ranks(lambda r: ranks[r].allreduce(torch.tensor(values[r])).tolist(), 3)
    if elastic:
        assert out == [[1.0, 2.0]] * 3 and all(ar.last_nonfinite == [1] for ar in ranks)
        assert ranks[0].last_participants == [0, 2]
    else:
        assert all(isinstance(e, RoundTimeoutError) and e.nonfinite == [1] for e in out), out
        assert len({str(e) for e in out}) == 1 and "rank 1: non-finite values (NaN or inf)" in str(out[0])
