"""How the engine replicas are deployed on Ray Serve: the deployment's name and options (its size,
overload bounds, autoscaling, router, health checks), read by the front end (ray_backend.py) and by
`build_app` (ray_replica.py) alike."""

from __future__ import annotations

from ray.serve.config import AutoscalingConfig, RequestRouterConfig

DEPLOYMENT_NAME = "rill-engine"


def deployment_options(settings) -> dict:
    """The Serve deployment of the replicas: size, overload bounds, autoscaling, router, health."""
    options = dict(
        name=DEPLOYMENT_NAME,
        # Twice what the replica's engine admits: Ray keeps routing to a full replica, whose engine
        # refuses with QueueFull (a 429 now) instead of Ray holding the request back unbounded.
        max_ongoing_requests=2 * (settings.max_num_seqs + settings.max_queue),
        # Requests waiting for a replica slot; Ray counts every request it is still routing, so a
        # burst of simultaneous arrivals needs this much room (past it: 429).
        max_queued_requests=settings.max_num_seqs + settings.max_queue,
        ray_actor_options={"num_cpus": settings.replica_cpus},
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=5.0,
        request_router_config=RequestRouterConfig(
            request_router_class="frontend.backends.ray_router.PrefixAffinityRouter",
            request_router_kwargs={"block_size": settings.block_size}),
    )
    if settings.max_replicas > settings.replicas:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=settings.replicas, max_replicas=settings.max_replicas,
            target_ongoing_requests=max(1, settings.max_num_seqs // 2))
    else:
        options["num_replicas"] = settings.replicas
    return options
