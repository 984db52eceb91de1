"""ModalExecutor and HFJobsExecutor through fakes of exactly the SDK surface they call.

The HF fake's methods are checked against the installed huggingface_hub's ``HfApi`` signatures, so a
keyword the executor passes that the real SDK does not accept fails here. ``modal`` is not installed in
this environment: its fake follows modal 1.6's public API (``Function.from_name``, ``with_options``,
``spawn``, ``FunctionCall.get/cancel/object_id/from_id``, ``Function.logs.tail``).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from composer_replication.diloco.serverless import HFJobsExecutor, ModalExecutor, ServerlessExecutor

# ---------------------------------------------------------------------------- fake modal


@dataclass
class FakeLogEntry:
    message: str
    context_ids: list[str] = field(default_factory=list)


class FakeFunctionCall:
    registry: dict[str, FakeFunctionCall] = {}

    def __init__(self, script: tuple, call_id: str) -> None:
        self.script, self.object_id, self.cancelled = list(script), call_id, False
        FakeFunctionCall.registry[call_id] = self

    @classmethod
    def from_id(cls, function_call_id: str) -> FakeFunctionCall:
        return cls.registry[function_call_id]

    def get(self, timeout: float | None = None, *, index: int = 0):
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if step[0] == "running":
            raise TimeoutError()  # what modal raises when no output is ready yet
        if step[0] == "raise":
            raise step[1]
        return step[1]

    def cancel(self, terminate_containers: bool = False) -> None:
        self.cancelled = terminate_containers


class FakeFunction:
    scripts: dict[int, tuple] = {}
    spawned: list[dict] = []
    options: dict = {}

    @classmethod
    def from_name(cls, app_name: str, name: str, *, version=None, environment_name=None, client=None):
        fn = cls()
        fn.app_name, fn.name = app_name, name
        return fn

    def with_options(
        self,
        *,
        cpu=None,
        memory=None,
        gpu=None,
        env=None,
        secrets=None,
        volumes=None,
        retries=None,
        max_containers=None,
        buffer_containers=None,
        scaledown_window=None,
        timeout=None,
        region=None,
        cloud=None,
        routing_region=None,
    ):
        FakeFunction.options = {"gpu": gpu, "timeout": timeout}
        return self

    def spawn(self, *args, **kwargs) -> FakeFunctionCall:
        FakeFunction.spawned.append(kwargs)
        return FakeFunctionCall(self.scripts[kwargs["rank"]], f"fc-{kwargs['rank']}")

    @property
    def logs(self):
        def tail(entries: int = 100, *, source=None):
            yield FakeLogEntry("rank 0 step 1\n", ["fc-0", "in-1"])
            yield FakeLogEntry("rank 1 step 1\n", ["fc-1", "in-2"])

        return types.SimpleNamespace(tail=tail)


@pytest.fixture
def fake_modal(monkeypatch: pytest.MonkeyPatch):
    module = types.ModuleType("modal")
    module.Function, module.FunctionCall = FakeFunction, FakeFunctionCall
    monkeypatch.setitem(sys.modules, "modal", module)
    FakeFunction.spawned.clear()
    return module


def test_modal_executor_launches_polls_collects(fake_modal) -> None:
    FakeFunction.scripts = {
        0: (("running",), ("ok", {"digest": "abc"})),
        1: (("raise", RuntimeError("OOM")),),
    }
    ex = ModalExecutor("diloco", poll_interval_s=0.01)
    assert isinstance(ex, ServerlessExecutor)
    args = {"rendezvous_uri": "s3://b/run", "world_size": 2, "trainer_module": "my.trainer"}
    handles = ex.launch_replicas(
        2, "composer_replication.diloco.serverless.replica_entrypoint", args, gpu="H100", timeout=600
    )
    assert FakeFunction.options == {"gpu": "H100", "timeout": 600}
    assert FakeFunction.spawned[1] == {
        "rank": 1,
        "entrypoint": "composer_replication.diloco.serverless.replica_entrypoint",
        "entrypoint_args": args,
    }
    assert [h.metadata["function_call_id"] for h in handles] == ["fc-0", "fc-1"]
    assert ex.poll(handles[0]) == "running"
    results = ex.collect(handles, timeout=10)
    assert results[0] == {
        "rank": 0,
        "status": "succeeded",
        "exit_code": 0,
        "error": None,
        "result": {"digest": "abc"},
    }
    assert results[1]["status"] == "failed" and results[1]["error"] == "RuntimeError: OOM"
    assert ex.stream_logs(handles[1]) == "rank 1 step 1\n"


def test_modal_cancel_and_collect_timeout(fake_modal) -> None:
    FakeFunction.scripts = {0: (("running",),), 1: (("running",),)}
    ex = ModalExecutor("diloco", poll_interval_s=0.01)
    h0, h1 = ex.launch_replicas(2, "pkg.mod.fn", {})
    ex.cancel(h0)
    assert ex.poll(h0) == "cancelled" and FakeFunctionCall.registry["fc-0"].cancelled is True
    results = ex.collect([h0, h1], timeout=0.2)
    assert results[0]["status"] == "cancelled"
    assert results[1]["status"] == "cancelled" and "collect(timeout=0.2)" in results[1]["error"]


def test_modal_refuses_callables_and_names_the_missing_package(fake_modal, monkeypatch) -> None:
    with pytest.raises(TypeError, match="dotted path"):
        ModalExecutor("diloco").launch_replicas(1, print, {})
    monkeypatch.setitem(sys.modules, "modal", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install modal"):
        ModalExecutor("diloco")


# ---------------------------------------------------------------------------- fake huggingface_hub


class FakeHfApi:
    calls: list[tuple[str, dict]] = []
    stages: dict[str, list[str]] = {}

    def __init__(self, token=None) -> None:
        self.token = token

    def _info(self, job_id: str, stage: str):
        status = types.SimpleNamespace(stage=stage, message="exit status 1" if stage == "ERROR" else None)
        return types.SimpleNamespace(id=job_id, url=f"https://huggingface.co/jobs/me/{job_id}", status=status)

    def run_job(
        self, *, image, command, env=None, secrets=None, flavor=None, timeout=None, namespace=None, token=None
    ):
        FakeHfApi.calls.append(
            (
                "run_job",
                {
                    "image": image,
                    "command": command,
                    "env": env,
                    "secrets": secrets,
                    "flavor": flavor,
                    "timeout": timeout,
                    "namespace": namespace,
                },
            )
        )
        return self._info(f"job{len(FakeHfApi.calls)}", "SCHEDULING")

    def inspect_job(self, *, job_id, namespace=None, token=None):
        seq = FakeHfApi.stages[job_id]
        return self._info(job_id, seq.pop(0) if len(seq) > 1 else seq[0])

    def fetch_job_logs(self, *, job_id, namespace=None, follow=False, tail=None, token=None):
        yield from (f"{job_id} line {i}" for i in range(5))

    def cancel_job(self, *, job_id, namespace=None, token=None):
        FakeHfApi.calls.append(("cancel_job", {"job_id": job_id}))
        FakeHfApi.stages[job_id] = ["CANCELED"]


@pytest.fixture
def fake_hf(monkeypatch: pytest.MonkeyPatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    FakeHfApi.calls.clear()
    return FakeHfApi


def test_hf_fake_matches_the_installed_sdk_signatures() -> None:
    real = pytest.importorskip("huggingface_hub").HfApi
    for name in ("run_job", "inspect_job", "fetch_job_logs", "cancel_job"):
        fake_params = set(inspect.signature(getattr(FakeHfApi, name)).parameters) - {"self"}
        real_params = set(inspect.signature(getattr(real, name)).parameters)
        assert fake_params <= real_params, (name, fake_params - real_params)
    stages = {s.value for s in pytest.importorskip("huggingface_hub").JobStage}
    from composer_replication.diloco.serverless.cloud import _STAGES

    assert stages <= set(_STAGES), stages - set(_STAGES)


def test_hf_jobs_executor_launches_polls_collects(fake_hf) -> None:
    ex = HFJobsExecutor(
        "pytorch/pytorch:latest",
        flavor="a10g-small",
        secrets={"AWS_ACCESS_KEY_ID": "k"},
        setup_command="pip install composer-replication[s3]",
        poll_interval_s=0.01,
    )
    args = {"rendezvous_uri": "s3://b/run", "world_size": 2, "trainer_module": "my.trainer"}
    handles = ex.launch_replicas(
        2, "composer_replication.diloco.serverless.replica_entrypoint", args, timeout=900
    )
    run = [c for n, c in fake_hf.calls if n == "run_job"]
    assert [c["env"] for c in run] == [{"REPLICA_RANK": "0"}, {"REPLICA_RANK": "1"}]
    assert (
        run[0]["flavor"] == "a10g-small"
        and run[0]["timeout"] == 900
        and run[0]["secrets"] == {"AWS_ACCESS_KEY_ID": "k"}
    )
    assert run[0]["command"][:2] == ["bash", "-c"] and run[0]["command"][2].startswith("pip install")
    fake_hf.stages = {"job1": ["SCHEDULING", "RUNNING", "COMPLETED"], "job2": ["RUNNING", "ERROR"]}
    assert ex.poll(handles[0]) == "pending" and ex.poll(handles[1]) == "running"
    results = ex.collect(handles, timeout=10)
    assert (results[0]["status"], results[0]["exit_code"], results[0]["error"]) == ("succeeded", 0, None)
    assert results[1]["status"] == "failed" and results[1]["error"] == "job job2 ERROR: exit status 1"
    assert ex.stream_logs(handles[0], n_lines=2) == "job1 line 3\njob1 line 4\n"


def test_hf_jobs_cancel_and_timeout(fake_hf) -> None:
    ex = HFJobsExecutor("img", poll_interval_s=0.01)
    (h,) = ex.launch_replicas(1, "pkg.fn", {})
    fake_hf.stages = {"job1": ["RUNNING"]}
    (r,) = ex.collect([h], timeout=0.1)
    assert r["status"] == "cancelled" and ("cancel_job", {"job_id": "job1"}) in fake_hf.calls
    assert ex.poll(h) == "cancelled"


@pytest.mark.slow
def test_hf_jobs_command_runs_a_replica_for_real(fake_hf, tmp_path: Path) -> None:
    """Run the exact command and environment an HF Job would get, here, as a subprocess."""
    ex = HFJobsExecutor("img", python=sys.executable)
    ex.launch_replicas(1, "tests_serverless_helpers.ok", {"value": 5})
    call = fake_hf.calls[0][1]
    env = {**os.environ, **call["env"], "PYTHONPATH": str(Path(__file__).parent)}
    out = subprocess.run(call["command"], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"result": {"rank": 0, "value": 5}}


def test_hf_jobs_names_the_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ImportError, match="pip install huggingface_hub"):
        HFJobsExecutor("img")
