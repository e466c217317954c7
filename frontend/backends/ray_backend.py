"""The ray backend: engine replicas as Ray Serve deployments, one rill engine each.

    front end (this process)                          Ray (local instance, or --ray-address)
    routes, page, resume, metrics, keys, limits       EngineReplica x N (ray_replica.py), each
    tokenizer (from a replica)   --- DeploymentHandle ---> one AsyncEngine, its KV cache, prefix cache
    PrefixAffinityRouter (ray_router.py)              StatsBoard: their stats, for /health, /metrics

Streaming: `handle.options(stream=True).generate.remote(...)`; the first item says whether the
replica's engine took the request (its own checks and admission: 400, 429, 503 as locally), the
rest are lists of `RequestOutput` with token ids, so a resumed stream continues on any replica.
Overload is rill's own admission: each replica's engine takes `max_num_seqs + max_queue`
sequences and refuses the next with QueueFull, a 429 with Retry-After. Ray Serve routes up to
twice that to a replica (`max_ongoing_requests`), so it never holds a request back while an engine
could refuse it, and its own bound (`max_queued_requests`, a BackPressureError) is a 429 too. A request whose replica died before it was taken is sent again (another
replica takes it); one that dies mid-stream ends with an error event. Ray Serve replaces the
dead replica (its health check and its actor's death).

Several models (`--model` again, `--models-dir`, `--models-preset`): one replica set per model, each
its own Serve application (`app_name`), deployed when the model loads and deleted when it unloads;
the replicas post to one board, each entry marked with its application.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import time
from pathlib import Path

import ray
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from frontend.backends import BackendError
from frontend.backends.ray_auth import check_cluster, use_token
from frontend.backends.ray_deployment import DEPLOYMENT_NAME
from frontend.backends.ray_replica import build_app, stats_board
from frontend.backends.remote import Admitted, Refused, RemoteEngine

log = logging.getLogger("rill.backend")

ROOT = Path(__file__).resolve().parents[2]
APP_NAME = "rill"
NAMESPACE = "rill"
POLL_PERIOD_S = 0.5  # how often the front reads the replicas' statistics
STALE_S = 10.0  # a replica that has not posted for this long counts as dead (a busy one posts late)
FORGET_S = 60.0  # and is dropped from /health after this long
FRESH_S = 3.0  # the test hook waits only for replicas that posted this recently (a killed one's entry lingers)
ADMIT_RETRIES = 3  # a replica that died before taking a request: try this many times in all
_live: set = set()  # the RayEngines of this process (one per loaded model)
_ray_started_here = False  # this process started the local Ray instance: the last engine closed stops it


def several_models(settings) -> bool:
    return len(getattr(settings, "models", ())) > 1 or bool(settings.models_dir) or bool(settings.models_preset)


def app_name(settings) -> str:
    """The Serve application of the model the settings load: `rill` for a server of one model (what a
    RayService deploys), else one per model and its own settings (a preset may load one file twice)."""
    if not several_models(settings):
        return APP_NAME
    from frontend.backends import iter_engine_fields

    digest = hashlib.sha256(repr(sorted(iter_engine_fields(settings))).encode()).hexdigest()[:8]
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", Path(str(settings.model_id or "embedded")).name)[:40]
    return f"{APP_NAME}-{stem}-{digest}"


def _start_ray(settings) -> bool:
    """Connect to the cluster at --ray-address, or start a local instance; True when started here."""
    if ray.is_initialized():
        return False
    quiet = dict(include_dashboard=False, namespace=NAMESPACE, logging_level=logging.WARNING,
                 log_to_driver=settings.log_level == "debug")
    token_source = None
    if settings.ray_address:  # a wrong or missing token, or no cluster there: one line now, not Ray's retries
        token_source = use_token(settings.ray_auth_token)
        check_cluster(settings.ray_address, token_source)
    try:
        if settings.ray_address:
            # The replicas import rill: ship this checkout to the cluster (an image with rill installed works too).
            ray.init(address=settings.ray_address, runtime_env={
                "working_dir": str(ROOT), "excludes": [".venv", ".git", "**/__pycache__", ".pytest_cache"]},
                **quiet)
            return False
        # A local instance: its workers inherit this environment, so they find rill on PYTHONPATH.
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        sets = settings.models_max if several_models(settings) else 1  # a replica set per loaded model
        cpus = max(1, round(settings.replicas * settings.replica_cpus * sets))
        ray.init(num_cpus=cpus, **quiet)
        return True
    except Exception as exc:  # noqa: BLE001 - one line for the operator
        where = f"--ray-address {settings.ray_address}" if settings.ray_address else "a local instance"
        hint = ("; if the cluster has token authentication on, give its token with --ray-auth-token "
                "(docs/scale-out.md)") if settings.ray_address and token_source is None else ""
        raise BackendError(f"Ray did not start ({where}): {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}{hint}") from exc


def _existing_app(app: str = APP_NAME):
    """The handle of a `rill` application already deployed on the cluster (by a RayService), or None."""
    try:
        if app in serve.status().applications:
            return serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app)
    except Exception:  # noqa: BLE001 - no Serve on the cluster yet
        log.debug("no Serve application on the cluster", exc_info=True)
    return None


def vars_of(settings) -> dict:
    """The settings as keyword arguments (what build_app takes)."""
    return {name: getattr(settings, name) for name in settings.__slots__}


class RayEngine(RemoteEngine):
    """The engine client over Ray Serve replicas."""

    backend = "ray"
    continuable = True  # replicas return token ids: a resumed stream continues from them

    def __init__(self, handle, board, info: dict, started_ray: bool, app: str = APP_NAME):
        global _ray_started_here
        _ray_started_here = _ray_started_here or started_ray
        self._app = app
        _live.add(self)
        self._handle = handle
        self._stream_handle = handle.options(stream=True)
        self._board = board
        self._info = {k: v for k, v in info.items() if k != "tokenizer"}
        self._started_ray = started_ray
        self._entries: dict[str, dict] = {}
        self.attention_path = info.get("attention_path", "paged")
        super().__init__(model_name=info["model_name"], max_model_len=info["max_model_len"],
                         tokenizer=info["tokenizer"])
        self._entries = ray.get(board.read.remote())
        self._poller = asyncio.run_coroutine_threadsafe(self._poll_forever(), self.loop)

    @classmethod
    def from_settings(cls, settings) -> "RayEngine":
        started = _start_ray(settings)
        app = app_name(settings)
        try:
            board = stats_board()
            handle = None if started else _existing_app(app)
            if handle is None:
                serve.start(proxy_location="Disabled")
                log.info("starting %d engine replica(s) of %s on Ray Serve", settings.replicas, app)
                handle = serve.run(build_app(vars_of(settings)), name=app, route_prefix=None)
            else:
                log.info("using the engine replicas of the Serve application %r already on the cluster", app)
            info = handle.info.remote().result()
        except Exception as exc:
            if started:
                ray.shutdown()
            elif app != APP_NAME:  # a model's replicas that did not start: nothing of it stays deployed
                try:
                    serve.delete(app)
                except Exception:  # noqa: BLE001 - the error below says why it failed
                    log.debug("deleting %s failed", app, exc_info=True)
            raise BackendError(f"the engine replicas did not start on Ray Serve: {type(exc).__name__}: "
                               f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}") from exc
        return cls(handle, board, info, started, app)

    # ---- state of the replicas ------------------------------------------------------------

    async def _poll_forever(self) -> None:
        while True:
            try:
                self._entries = await self._board.read.remote()
            except Exception:  # noqa: BLE001 - the board restarts with Ray; keep the last view
                log.debug("reading the replicas' statistics failed", exc_info=True)
            await asyncio.sleep(POLL_PERIOD_S)

    def replica_stats(self) -> list[dict]:
        now = time.time()
        entries = []
        for replica, entry in sorted(self._entries.items(), key=lambda item: item[1].get("started", 0)):
            if (entry.get("app") or APP_NAME) != self._app:  # another model's replicas
                continue
            age = now - entry.get("time", 0)
            if age > FORGET_S:
                continue
            entries.append({**entry, "replica": replica, "alive": bool(entry.get("alive")) and age < STALE_S})
        return entries

    def stats(self):
        from frontend.backends.remote import aggregate_stats

        return aggregate_stats([e["engine"] for e in self.replica_stats() if e["alive"]])

    @property
    def alive(self) -> bool:
        return not self._stopping and any(entry["alive"] for entry in self.replica_stats())

    def unavailable_reason(self) -> str:
        return ("No engine replica is running (they are starting, or restarting after a failure). "
                "Retry in a moment; /health lists the replicas.")

    def health_info(self) -> dict:
        replicas = self.replica_stats()
        return {"backend": "ray", "weights": self._info.get("weights"), "linears": self._info.get("linears"),
                "decode_attention": self._info.get("decode_attention"),
                "engine_restarts": sum(int(e.get("engine_restarts", 0)) for e in replicas),
                "replicas": [{"replica": e["replica"], "pid": e.get("pid"), "alive": e["alive"],
                              "requests_total": e.get("requests_total", 0), "engine": e.get("engine")}
                             for e in replicas]}

    # ---- one request ----------------------------------------------------------------------

    async def _open(self, request_id, prompt_token_ids, params, prior_output_ids, session):
        handle = self._stream_handle if not session else self._handle.options(stream=True, session_id=session)
        response, first = None, None
        for attempt in range(ADMIT_RETRIES):
            try:
                response = handle.generate.remote(prompt_token_ids=prompt_token_ids, params=params,
                                                  request_id=request_id, prior_output_ids=prior_output_ids)
                first = await response.__anext__()
                break
            except BackPressureError:
                if response is not None:
                    response.cancel()
                raise Refused("queue_full", "Every engine replica is at capacity and the queue in front of them "
                                            "is full. Retry in a moment.") from None
            except (ActorDiedError, ActorUnavailableError, RayActorError):
                response.cancel()  # that replica died before it took the request: another one may
                if attempt + 1 == ADMIT_RETRIES:
                    raise
                await asyncio.sleep(0.2 * (attempt + 1))
        try:
            if "refused" in first:
                raise Refused(first["refused"], first["message"], first.get("param"))
            yield Admitted(first["admitted"])
            async for batch in response:
                yield batch
        finally:
            response.cancel()  # a no-op once the stream ended; else the replica aborts the request

    def delay_steps(self, seconds: float, timeout: float = 30.0) -> None:
        """Test hook (--test-hooks): every replica's steps sleep `seconds` first. Returns once each
        live replica has posted that it applied it (they read it from the board as they post)."""
        ray.get(self._board.set_step_delay.remote(seconds))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            now, entries = time.time(), ray.get(self._board.read.remote()).values()
            live = [e for e in entries if e.get("alive") and now - e.get("time", 0) < FRESH_S]
            if live and all(e.get("step_delay_s") == max(0.0, seconds) for e in live):
                return
            time.sleep(0.05)
        raise TimeoutError(f"the replicas did not apply a step delay of {seconds:g} s within {timeout:g} s")

    def failure_message(self, exc: BaseException) -> str:
        if isinstance(exc, (RayActorError, ActorUnavailableError)):
            return ("The engine replica serving this request stopped (its process died); the other replicas "
                    "take new requests and Ray starts a new one. Send the request again.")
        return "The engine replica's stream broke off; send the request again."

    def _close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        global _ray_started_here
        _live.discard(self)
        try:
            if _ray_started_here and not _live:  # the last model's replicas: the local instance goes too
                serve.shutdown()
                ray.shutdown()
                _ray_started_here = False
            else:  # this model unloaded: its replicas go, the other models' stay
                serve.delete(self._app)
        except Exception:  # noqa: BLE001 - shutting down anyway
            log.warning("stopping the Ray Serve application failed", exc_info=True)
