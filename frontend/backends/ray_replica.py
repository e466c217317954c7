"""One engine replica as a Ray Serve deployment (runs in a Ray worker process), and the board
where the replicas post their statistics for the front end's /health and /metrics.

`EngineReplica.generate` is a streaming method: it yields `{"admitted": replica}` (or
`{"refused": kind, ...}` and stops) and then lists of `RequestOutput`, one list per engine
step that produced something for the request. When the front end cancels the call (its client
left), Ray Serve cancels this generator: the `finally` aborts the request in the engine, whose
KV blocks are free before its next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time

import ray
from ray import serve

log = logging.getLogger("rill.replica")

BOARD_NAME = "rill-stats-board"
BOARD_NAMESPACE = "rill"
REPORT_PERIOD_S = 0.5  # how often a replica posts its statistics


@ray.remote(num_cpus=0)
class StatsBoard:
    """The latest statistics each replica posted (replica id -> entry with its wall time)."""

    def __init__(self):
        self.entries: dict[str, dict] = {}
        self.step_delay_s = 0.0  # test hook (--test-hooks): what every replica's steps sleep first

    def post(self, replica: str, entry: dict) -> float:
        self.entries[replica] = entry
        return self.step_delay_s

    def set_step_delay(self, seconds: float) -> None:
        self.step_delay_s = max(0.0, float(seconds))

    def read(self) -> dict[str, dict]:
        return self.entries

    def forget(self, replica: str) -> None:
        self.entries.pop(replica, None)


def stats_board():
    """The board, made by whoever comes first (the front end, or a replica deployed by a RayService)."""
    return StatsBoard.options(name=BOARD_NAME, namespace=BOARD_NAMESPACE, get_if_exists=True,
                              lifetime="detached").remote()


def build_app(args: dict):
    """The replicas as a Serve application, for `serve run` or a KubeRay RayService's serveConfigV2
    (`import_path: frontend.backends.ray_replica:build_app`, `args`: app.py's settings by name, e.g.
    {"model_id": "HuggingFaceTB/SmolLM2-135M-Instruct", "replicas": 4, "max_replicas": 16})."""
    from frontend.backends import iter_engine_fields
    from frontend.backends.ray_deployment import deployment_options
    from frontend.settings import Settings

    settings = Settings(**args)
    return serve.deployment(EngineReplica, **deployment_options(settings)).bind(
        dict(iter_engine_fields(settings)), max(1, int(settings.replica_cpus)), bool(settings.test_hooks))


def stats_dict(stats) -> dict:
    """EngineStats as plain values (finish reasons by name)."""
    entry = dataclasses.asdict(stats)
    entry["finished_total"] = {getattr(k, "value", str(k)): v for k, v in dict(stats.finished_total).items()}
    return entry


class EngineReplica:
    """One rill engine; Ray Serve makes `num_replicas` of these, each in its own process."""

    def __init__(self, fields: dict, threads: int, test_hooks: bool = False):
        import torch

        from frontend.backends.local import load_engine

        torch.set_num_threads(max(1, int(threads)))  # this replica's share of the cores
        self.engine = load_engine(fields).start()
        context = serve.get_replica_context()
        self.replica = getattr(context.replica_id, "unique_id", None) or str(context.replica_tag)
        # its Serve application: with several models, each model's replica set is one (ray_backend.app_name)
        self.app = getattr(getattr(context.replica_id, "deployment_id", None), "app_name", None)
        self.pid = os.getpid()
        self.started = time.time()
        self.requests_total = 0  # requests this replica admitted
        self.test_hooks = test_hooks  # then the steps sleep what the board says (the front's /_test/slow-steps)
        self.step_delay_s = 0.0
        self._board = stats_board()
        self._stop = threading.Event()
        threading.Thread(target=self._report_forever, name="rill-replica-stats", daemon=True).start()

    def info(self) -> dict:
        """What the front end needs once: the tokenizer and the model's numbers."""
        engine = self.engine
        return {"model_name": engine.model_name, "max_model_len": engine.max_model_len,
                "tokenizer": engine.tokenizer, "weights": engine.loaded.weights, "linears": engine.core.linears,
                "decode_attention": engine.core.decode_attention,
                "attention_path": engine.attention_path, "block_size": engine.config.block_size,
                "num_kv_blocks": engine.core.num_kv_blocks}

    async def generate(self, prompt_token_ids: list[int], params, request_id: str, prior_output_ids: list[int]):
        from engine.request import InvalidRequest, QueueFull

        try:
            if params.constraint is not None:  # compiled before admission, as the routes do on one machine
                await asyncio.to_thread(self.engine.compile_constraint, params)
            stream = self.engine.add_request(prompt_token_ids, params, request_id, prior_output_ids)
        except InvalidRequest as exc:
            yield {"refused": "invalid", "message": str(exc), "param": exc.param}
            return
        except QueueFull as exc:
            yield {"refused": "queue_full", "message": str(exc)}
            return
        except RuntimeError as exc:  # the engine is not running (rebuilding after a fault, stopping)
            yield {"refused": "unavailable", "message": str(exc)}
            return
        self.requests_total += 1
        yield {"admitted": self.replica}
        finished = False
        try:
            while not stream.done:
                out = await stream.next()
                if out is None:
                    continue
                batch = [out]
                while stream._items:  # what else this step brought (other samples of the request)
                    batch.append(await stream.next())
                yield batch
            finished = True
        finally:
            if not finished:  # cancelled by the front end (its client left) or failed
                self.engine.abort(request_id)

    def check_health(self) -> None:
        """Ray Serve calls this periodically; a replica whose engine stays dead is replaced."""
        if self.engine.dead is not None and self.engine._thread is not None and not self.engine._thread.is_alive():
            raise RuntimeError("the engine of this replica stopped for good")

    def _entry(self) -> dict:
        return {"replica": self.replica, "app": self.app, "pid": self.pid, "time": time.time(), "started": self.started,
                "alive": bool(self.engine.alive), "requests_total": self.requests_total, "step_delay_s": self.step_delay_s,
                "engine_restarts": self.engine.num_restarts, "engine": stats_dict(self.engine.stats())}

    def _take_step_delay(self, delay: float) -> None:
        """Test hook: sleep `delay` s before each step, as the board says, and post that it is done
        (the front's /_test/slow-steps answers once every replica has)."""
        if delay != self.step_delay_s:
            from testing.hooks import delay_steps

            delay_steps(self.engine.core, delay)
            self.step_delay_s = delay
            self._board.post.remote(self.replica, self._entry())

    def _report_forever(self) -> None:
        while True:
            try:
                posted = self._board.post.remote(self.replica, self._entry())
                if self.test_hooks:
                    self._take_step_delay(ray.get(posted, timeout=5))
            except Exception:  # noqa: BLE001 - the board is gone (the front end stopped); try again later
                log.debug("posting statistics failed", exc_info=True)
            if self._stop.wait(REPORT_PERIOD_S):
                return

    def __del__(self):
        self._stop.set()
