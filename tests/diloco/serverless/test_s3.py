"""ObjectStoreAllReduce over s3:// against a local moto server; credentials errors at the first allreduce."""

from __future__ import annotations

import uuid

import pytest
import s3fs
import torch
from tests_serverless_helpers import run_ranks

from composer_replication.diloco.serverless import ObjectStoreAllReduce, StoreAccessError
from composer_replication.diloco.serverless.store import create_exclusive

FAST = {"timeout_s": 10.0, "poll_interval_s": 0.02}


@pytest.mark.parametrize("world_size", [2, 3])
def test_s3_ranks_agree_on_the_mean_with_rendezvous(moto_s3: dict, world_size: int) -> None:
    uri = f"s3://bucket/run-{uuid.uuid4().hex[:8]}"

    def rank_fn(r: int):
        ar = ObjectStoreAllReduce(uri, r, world_size, storage_options=moto_s3, **FAST)
        a = ar.allreduce(torch.full((4,), float(r)))
        b = ar.allreduce(torch.arange(3.0) * (r + 1))
        return a, b, ar.run_id

    out = run_ranks(rank_fn, world_size)
    assert not any(isinstance(o, Exception) for o in out), out
    mean_r = sum(range(world_size)) / world_size
    mean_k = sum(range(1, world_size + 1)) / world_size
    for a, b, run_id in out:
        assert a.tolist() == [mean_r] * 4 and b.tolist() == [0.0, mean_k, 2 * mean_k]
        assert run_id == out[0][2]


def test_s3_missing_rank_is_named(moto_s3: dict) -> None:
    ar = ObjectStoreAllReduce(
        f"s3://bucket/{uuid.uuid4().hex}",
        0,
        2,
        run_id="m",
        timeout_s=0.3,
        poll_interval_s=0.02,
        storage_options=moto_s3,
    )
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\]"):
        ar.allreduce(torch.ones(2))


def test_s3_exclusive_create_has_one_winner(moto_s3: dict) -> None:
    fs = s3fs.S3FileSystem(**moto_s3)
    path = f"bucket/{uuid.uuid4().hex}/decision.json"
    assert create_exclusive(fs, path, b"first") is True
    assert create_exclusive(fs, path, b"second") is False
    assert fs.cat_file(path) == b"first"


def test_s3_without_credentials_fails_at_first_allreduce_saying_where_they_come_from(
    moto_s3: dict, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    options = {k: v for k, v in moto_s3.items() if k not in ("key", "secret")}
    ar = ObjectStoreAllReduce("s3://bucket/nocreds", 0, 2, run_id="c", timeout_s=2, storage_options=options)
    with pytest.raises(StoreAccessError, match="AWS_ACCESS_KEY_ID"):
        ar.allreduce(torch.ones(1))


@pytest.fixture(scope="module")
def moto_server_process():
    """A standalone ``moto_server`` process on 127.0.0.1 (what a user's MinIO or moto looks like): its endpoint."""
    import shutil
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.skip("moto_server did not start")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def test_standalone_s3_server_through_the_recipes_storage_options(moto_server_process: str, monkeypatch) -> None:
    """docs/diloco.md, "Object stores and storage options": --storage-option pairs reach fsspec; AWS_ENDPOINT_URL
    works without them."""
    import boto3

    from recipes.serverless.run import parse_args

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    boto3.client("s3", endpoint_url=moto_server_process).create_bucket(Bucket="diloco")
    args = parse_args(["--store", "s3://diloco/run", "--storage-option",
                       f"client_kwargs.endpoint_url={moto_server_process}", "--storage-option", "skip_instance_cache=true"])
    assert args.storage_options == {"client_kwargs": {"endpoint_url": moto_server_process}, "skip_instance_cache": True}
    out = run_ranks(lambda r: ObjectStoreAllReduce("s3://diloco/a", r, 2, storage_options=args.storage_options,
                                                   **FAST).allreduce(torch.full((2,), float(r))).tolist(), 2)
    assert out == [[0.5, 0.5]] * 2, out
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server_process)  # botocore >= 1.31 reads it: no options needed
    out = run_ranks(lambda r: ObjectStoreAllReduce("s3://diloco/b", r, 2, storage_options={"skip_instance_cache": True},
                                                   **FAST).allreduce(torch.full((2,), float(r))).tolist(), 2)
    assert out == [[0.5, 0.5]] * 2, out


def test_bad_storage_options_are_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    from recipes.serverless.run import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--store", "s3://b/r", "--storage-option", "endpoint"])
    assert info.value.code == 2 and "--storage-option must look like key=value" in capsys.readouterr().err
