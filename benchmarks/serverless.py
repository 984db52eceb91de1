"""Object-store allreduce vs gloo: throughput of one DiLoCo-style round, and the bytes each replica moves.

Serverless DiLoCo (docs/diloco.md) sends the outer step's pseudo-gradients through an object store. N
replica processes average one float32 tensor per round through ``file://``, through ``s3://`` (a moto
server on 127.0.0.1: HTTP, no WAN) and through gloo over loopback TCP, each counting the bytes it writes
and reads. Throughput: tensor bytes / seconds per round (median, after one warm-up round); store poll
interval ``--poll-interval-s`` (0.01 s; the library's 1 s default adds up to a second per round).

    python -m benchmarks.serverless                       # 2 replicas; 1, 8, 32 MB
    python -m benchmarks.serverless --sizes-mb 4 --rounds 3 --no-record
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import time
import uuid

import torch

from benchmarks.report import command, parser, record, table


def _worker(rank: int, world: int, uri: str, options: dict | None, numel: int, rounds: int, poll: float, out) -> None:
    """One replica: ``rounds`` + 1 averages of a float32 ``[numel]`` tensor through the object store at ``uri``, or
    (``options`` None) through gloo initialised at ``uri``; puts its round times (warm-up dropped) and the bytes
    it wrote and read in the last round."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    t, ar = torch.full((numel,), float(rank)), None
    if options is None:
        dist.init_process_group("gloo", init_method=uri, rank=rank, world_size=world)
    else:
        from composer_replication.diloco.serverless import ObjectStoreAllReduce

        ar = ObjectStoreAllReduce(uri, rank, world, run_id="bench", timeout_s=300, poll_interval_s=poll,
                                  storage_options=options, keep_objects=True)
    times = []
    for k in range(rounds + 1):
        before, t0 = (ar.bytes_written, ar.bytes_read) if ar else (0, 0), time.perf_counter()
        if ar is None:
            dist.all_reduce(t)
            t /= world
        else:
            ar.allreduce(t, name=f"round{k}")
        times.append(time.perf_counter() - t0)
    assert abs(t[0].item() - (world - 1) / 2) < 1e-6, "allreduce result is wrong"
    if ar is None:
        dist.destroy_process_group()
    written, read = (ar.bytes_written - before[0], ar.bytes_read - before[1]) if ar else (0, 0)
    out.put({"rank": rank, "times": times[1:], "written": written, "read": read})


def _run(args: tuple, world: int) -> list[dict]:
    """Every rank's :func:`_worker` with ``args`` in its own (spawned) process; their results by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(60)
    return sorted(results, key=lambda r: r["rank"])


def _moto() -> tuple[object, dict]:
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    url = "http://{}:{}".format(*server.get_host_and_port())
    boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="bench",
                 aws_secret_access_key="bench").create_bucket(Bucket="bench")
    return server, {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": url, "region_name": "us-east-1"}}


def measure(sizes_mb: list[float], world: int, rounds: int, poll: float) -> list[dict]:
    """One row per (transport, size): median seconds per round, MB/s, bytes written/read per replica."""
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server, s3_options = _moto()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for mb in sizes_mb:
                numel = int(mb * 2**20) // 4
                runs = {"gloo (loopback TCP)": (f"file://{tmp}/gloo-{uuid.uuid4().hex}", None),
                        "object store, file://": (f"file://{tmp}/store-{uuid.uuid4().hex}", {}),
                        "object store, s3:// (moto)": (f"s3://bench/{uuid.uuid4().hex}", s3_options)}
                for name, (uri, options) in runs.items():
                    res = _run((uri, options, numel, rounds, poll), world)
                    sec = statistics.median(max(r["times"][k] for r in res) for k in range(rounds))
                    rows.append({"transport": name, "mb": mb, "seconds": sec, "mb_per_s": mb / sec,
                                 "written": res[0]["written"], "read": res[0]["read"]})
                    print(f"{name:28s} {mb:6.1f} MB  {sec * 1e3:9.1f} ms/round  {mb / sec:8.1f} MB/s", flush=True)
    finally:
        server.stop()
    return rows


def to_markdown(rows: list[dict], world: int, rounds: int, poll: float, cmd: str) -> str:
    """The serverless section of docs/benchmarks.md: one row per (transport, size), then what it means."""
    gloo = {r["mb"]: r["seconds"] for r in rows if r["transport"].startswith("gloo")}
    lines = [
        "# Serverless DiLoCo: object-store allreduce vs gloo", "", f"Command: `{cmd}`", "",
        f"{world} replica processes, one float32 tensor per round, median of {rounds} rounds after a warm-up "
        f"(a round ends when the slowest replica has the mean); store poll interval {poll} s; s3:// is a moto "
        "server on 127.0.0.1 (HTTP, no WAN: a real bucket adds its own latency and bandwidth limits).",
        "", *table(["transport", "tensor MB", "ms / round", "MB/s (tensor / time)", "x gloo time",
                    "written / replica / round", "read / replica / round"],
                   [[r["transport"], f"{r['mb']:g}", f"{r['seconds'] * 1e3:.1f}", f"{r['mb_per_s']:.1f}",
                     f"{r['seconds'] / gloo[r['mb']]:.1f}",
                     *(["network, no store"] * 2 if r["transport"].startswith("gloo")
                       else [f"{r['written'] / 2**20:.2f} MB", f"{r['read'] / 2**20:.2f} MB"])] for r in rows],
                   ["---"] + ["---:"] * 6),
    ]
    lines += ["", f"Per round each replica uploads its tensor once and downloads the other {world - 1} replicas' "
              "(what that costs against a ring allreduce: the prose after this section)."]
    biggest = max(r["mb"] for r in rows)
    model_mb = 135e6 * 4 / 2**20  # SmolLM2-135M's pseudo-gradient in float32
    gloo_s = model_mb / (biggest / gloo[biggest])
    lines += [f"- At the {biggest:g} MB rate, {r['transport']} would move a 135M-parameter float32 pseudo-gradient "
              f"({model_mb:.0f} MB) in about {model_mb / r['mb_per_s']:.0f} s per round (gloo: {gloo_s:.1f} s)."
              for r in rows if r["mb"] == biggest and not r["transport"].startswith("gloo")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 8.0, 32.0], help="tensor sizes in MB")
    p.add_argument("--replicas", type=int, default=2, help="replica processes")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds per size (after one warm-up)")
    p.add_argument("--poll-interval-s", type=float, default=0.01, help="store poll interval")
    args = p.parse_args(argv)
    rows = measure(args.sizes_mb, args.replicas, args.rounds, args.poll_interval_s)
    md = to_markdown(rows, args.replicas, args.rounds, args.poll_interval_s, command("serverless", argv))
    record(args, "serverless", md, echo=True)


if __name__ == "__main__":
    main()
