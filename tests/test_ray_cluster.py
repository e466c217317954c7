"""--backend ray --ray-address against a Ray cluster started apart, as a user starts one: a head
process (`ray start --head`) and a worker process (`ray start --address`), token authentication
on, everything on 127.0.0.1. The front end gets the cluster's address and token, ships this
checkout to the cluster, and its one replica runs on the worker node (the head has no CPU).

On Linux Ray replaces 127.0.0.1 with the host's network address (as its node IP, and in the
address it dials). The cluster, and the front end, run with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0,
which keeps 127.0.0.1; with it `ray start` refuses to start a worker node at all, so the worker
joins through a RAY_START_HOOK that keeps its address (Ray issue 59110: `ray start --address
127.0.0.1:PORT` dials the host's address). The test checks the addresses the nodes registered,
what the cluster's servers listen on, and that no process of the cluster or the front talks to
anything but the loopback address.

The cluster stops by SIGTERM to its two `ray start --block` processes (Ray's own node shutdown,
draining off). Not `ray stop`: in Ray 2.60 it has no temp-dir or session option and stops every
Ray process of the machine's user, other test runs' included. Afterwards no process may be left
whose command line names the cluster's temp dir or whose environment names its token file."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from tests.servers import ROOT, clean_env, free_port, free_ports, python, run_server

pytest.importorskip("ray.serve", reason="--backend ray needs requirements-ray.txt")
pytestmark = [pytest.mark.ray, pytest.mark.server]

START_TIMEOUT_S = 90.0
RAY_VARIABLES = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_START_HOOK",
                 "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray keeps 127.0.0.1 (see the module docstring)

LOOPBACK_HOOK = '''
def keep_loopback(ray_params, head):
    """RAY_START_HOOK of the worker node: join the head at 127.0.0.1 as 127.0.0.1."""
    from ray._private import ray_constants, services

    ray_constants.ENABLE_RAY_CLUSTER = True  # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 made `ray start` refuse a worker
    services.resolve_ip_for_localhost = lambda host: host  # keep the head's 127.0.0.1 (not the host's address)
    ray_params.update(node_ip_address="127.0.0.1")
'''

CHECK_SCRIPT = '''
import sys
from frontend.backends import BackendError
from frontend.backends.ray_auth import check_cluster, use_token
try:
    check_cluster(sys.argv[1], use_token(sys.argv[2]))
    print("no error")
except BackendError as exc:
    print(exc)
'''


@dataclass
class RayCluster:
    """A head and a worker node, each a `ray start --block` process, token authentication on."""

    address: str  # the head's GCS, 127.0.0.1:PORT
    token: str
    temp_dir: Path  # the token file, the hook, the logs, and Ray's --temp-dir (sessions, sockets)
    ports: Iterator[int]  # every port the two nodes take, drawn at once so that no two are the same
    head: subprocess.Popen | None = None
    worker: subprocess.Popen | None = None

    def processes(self) -> list[psutil.Process]:
        """Every live process of this cluster: its command line names the temp dir, or its
        environment the token file (Ray's workers rename themselves `ray::...`)."""
        marker, found = str(self.temp_dir), []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if marker in " ".join(proc.cmdline()) or any(marker in v for v in proc.environ().values()):
                    found.append(proc)
        return found

    def nodes(self, token: str | None = "cluster's", timeout: float = 10.0) -> list:
        """The nodes its GCS lists (GcsNodeInfo), asked with its token (or `token`; None: none sent)."""
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

        token = self.token if token == "cluster's" else token
        with grpc.insecure_channel(self.address) as channel:
            return list(gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetAllNodeInfo(
                gcs_service_pb2.GetAllNodeInfoRequest(), timeout=timeout,
                metadata=[("authorization", f"Bearer {token}")] if token else None).node_info_list)

    def wait_for_nodes(self, count: int) -> None:
        import grpc
        from ray.core.generated import gcs_pb2

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and all(p.poll() is None for p in (self.head, self.worker) if p):
            with contextlib.suppress(grpc.RpcError):
                if sum(n.state == gcs_pb2.GcsNodeInfo.ALIVE for n in self.nodes(timeout=2)) >= count:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the Ray head at {self.address} did not list {count} live node(s):\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.temp_dir.glob("*.log"))

    def stop(self) -> None:
        """SIGTERM to the worker's and the head's `ray start`; then no process of the cluster may be left."""
        for process in (self.worker, self.head):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(10)
        _, stray = psutil.wait_procs(self.processes(), timeout=10)
        for proc in stray:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        assert not stray, f"Ray processes left after the cluster stopped: {[(p.pid, p.name()) for p in stray]}"


def _ray_start(cluster: RayCluster, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """`ray start --block ARGS` in its own session, every port it would take by default a free one."""
    ports = [x for flag in ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
                            "--metrics-export-port") for x in (flag, str(next(cluster.ports)))]
    with open(cluster.temp_dir / f"{name}.log", "wb") as log:
        return subprocess.Popen([str(Path(python()).parent / "ray"), "start", "--block", "--disable-usage-stats",
                                 "--temp-dir", str(cluster.temp_dir / "ray"), *args, *ports],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_started(cluster: RayCluster, name: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while "Ray runtime started" not in (cluster.temp_dir / f"{name}.log").read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"`ray start` ({name}) did not start:\n{cluster.logs()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_cluster():
    ports = iter(free_ports(13))  # the GCS, the dashboard, the client server, 2 metrics ports, 4 agents' a node
    cluster = RayCluster(f"127.0.0.1:{next(ports)}", secrets.token_hex(32),
                         Path(tempfile.mkdtemp(prefix="rill-ray-")), ports)  # short: Ray's socket paths live under it
    (cluster.temp_dir / "token").write_text(cluster.token)
    (cluster.temp_dir / "hook").mkdir()
    (cluster.temp_dir / "hook" / "rill_ray_loopback.py").write_text(LOOPBACK_HOOK)
    with pytest.MonkeyPatch.context() as patch:
        for name in RAY_VARIABLES:  # the tester's own are not this cluster's, nor the front's
            patch.delenv(name, raising=False)
        env = clean_env({**LOOPBACK, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(cluster.temp_dir / "token"),
                         "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # SIGTERM stops a node at once, not in 30 s
                         "AUTOSCALER_METRIC_PORT": str(next(ports)), "DASHBOARD_METRIC_PORT": str(next(ports))})
        try:
            cluster.head = _ray_start(cluster, "head", [
                "--head", "--node-ip-address", "127.0.0.1", "--port", cluster.address.rsplit(":", 1)[1],
                "--num-cpus", "0", "--include-dashboard", "false", "--dashboard-port", str(next(ports)),
                "--ray-client-server-port", str(next(ports))], env)
            cluster.wait_for_nodes(0)  # the GCS answers: the worker can join while the head starts the rest
            cluster.worker = _ray_start(cluster, "worker", ["--address", cluster.address, "--num-cpus", "1"], {
                **env, "PYTHONPATH": str(cluster.temp_dir / "hook"), "RAY_START_HOOK": "rill_ray_loopback.keep_loopback"})
            _wait_started(cluster, "head", cluster.head)
            _wait_started(cluster, "worker", cluster.worker)
            cluster.wait_for_nodes(2)
            yield cluster
        finally:
            try:
                cluster.stop()
            finally:
                shutil.rmtree(cluster.temp_dir, ignore_errors=True)


def _non_loopback_peers(pids: list[int]) -> list[tuple]:
    """Connections of these processes to any address but 127.0.0.1 or ::1."""
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            for conn in psutil.Process(pid).net_connections("inet"):
                if conn.raddr and conn.raddr.ip.removeprefix("::ffff:") not in ("127.0.0.1", "::1"):
                    found.append((pid, conn.laddr, conn.raddr, conn.status))
    return found


def _listening_addresses(processes: list[psutil.Process]) -> set[str]:
    addresses = set()
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            addresses |= {c.laddr.ip for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    return addresses


def test_the_front_end_serves_through_a_cluster_started_apart_with_token_auth_on_loopback(ray_cluster,
                                                                                         tiny_llama_path):
    import grpc

    with pytest.raises(grpc.RpcError) as refused:
        ray_cluster.nodes(token=None)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED  # token authentication is on
    nodes = sorted(ray_cluster.nodes(), key=lambda n: not n.is_head_node)
    assert [(n.node_manager_address, n.is_head_node, n.resources_total.get("CPU", 0)) for n in nodes] == [
        ("127.0.0.1", True, 0), ("127.0.0.1", False, 1)]  # not the host's interface
    servers = [p for p in ray_cluster.processes() if p.name() in ("gcs_server", "raylet")]
    assert len(servers) == 3 and _listening_addresses(servers) <= {"127.0.0.1", "::ffff:127.0.0.1"}

    flags = ("--model", str(tiny_llama_path), "--backend", "ray", "--replicas", "1",
             "--ray-address", ray_cluster.address, "--ray-auth-token", ray_cluster.token)
    with run_server(*flags, env=LOOPBACK, timeout=START_TIMEOUT_S) as front:
        body = {"messages": [{"role": "user", "content": "Hello there!"}], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        response = httpx.post(f"{front.url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["choices"][0]["message"]["content"] and answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 8
        replicas = front.health()["replicas"]
        assert [r["alive"] for r in replicas] == [True], replicas
        # The replica runs on the worker node: a descendant of the worker's `ray start`.
        assert ray_cluster.worker.pid in {p.pid for p in psutil.Process(replicas[0]["pid"]).parents()}
        assert not _non_loopback_peers([front.process.pid, *(p.pid for p in ray_cluster.processes())])


def test_a_missing_or_wrong_token_stops_the_start_with_one_line_saying_what_to_do(ray_cluster, tiny_llama_path):
    flags = ("--model", str(tiny_llama_path), "--backend", "ray", "--replicas", "1", "--ray-address",
             ray_cluster.address)
    runs = {  # at once: each pays app.py's imports
        "missing": (python(), "app.py", "--port", str(free_port()), *flags),
        "wrong": (python(), "app.py", "--port", str(free_port()), *flags, "--ray-auth-token", "not-the-token"),
    }
    runs = {name: subprocess.Popen(args, cwd=ROOT, env=clean_env(LOOPBACK), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for name, args in runs.items()}
    # Without the loopback variable Ray would dial the host's address: that is one line too (the
    # check alone, without app.py's imports).
    without_loopback = subprocess.run([python(), "-c", CHECK_SCRIPT, ray_cluster.address, ray_cluster.token],
                                      cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert without_loopback.stdout.strip() == (
        f"--ray-address {ray_cluster.address}: the Ray cluster runs on the loopback address (127.0.0.1), and Ray "
        "replaces 127.0.0.1 with this host's network address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; set "
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 for app.py as for `ray start` (docs/scale-out.md)"), without_loopback
    expected = {
        "missing": "the Ray cluster has token authentication on and rill sent no token; give its token with "
                   "--ray-auth-token or RAY_AUTH_TOKEN, or a file holding it with RAY_AUTH_TOKEN_PATH",
        "wrong": "the Ray cluster refused the token from --ray-auth-token or RAY_AUTH_TOKEN; give the cluster's own "
                 "token with --ray-auth-token or RAY_AUTH_TOKEN",
    }
    for name, run in runs.items():
        status, (_, stderr) = run.wait(120), run.communicate()
        lines = stderr.strip().splitlines()
        assert status == 2 and "Traceback" not in stderr, (name, stderr[-4000:])
        assert lines[-1] == (f"app.py: error: --ray-address {ray_cluster.address}: {expected[name]} "
                             "(`ray get-auth-token` on the head node prints it)"), (name, stderr[-4000:])
