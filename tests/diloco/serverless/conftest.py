"""A moto S3 server on 127.0.0.1 (random port, dummy credentials) for the s3:// tests."""

from __future__ import annotations

import logging

import pytest

logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's per-request lines


@pytest.fixture(scope="module")
def moto_s3():
    """``storage_options`` for s3fs pointing at a fresh moto server with bucket ``bucket`` created."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {
        "key": "testing",
        "secret": "testing",
        "skip_instance_cache": True,
        "client_kwargs": {"endpoint_url": f"http://{host}:{port}", "region_name": "us-east-1"},
    }
    import boto3

    boto3.client(
        "s3",
        endpoint_url=options["client_kwargs"]["endpoint_url"],
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).create_bucket(Bucket="bucket")
    try:
        yield options
    finally:
        server.stop()
