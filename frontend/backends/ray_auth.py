"""The front end's side of a Ray cluster started apart (--ray-address): Ray's token
authentication, and a look at the cluster before `ray.init`, so that what is wrong is one line.

Token authentication (Ray 2.52 and later). With RAY_AUTH_MODE=token every RPC and HTTP entry of
the cluster wants one shared token. Ray 2.60 turns it on for a local `ray.init()` (which writes a
token to ~/.ray/auth_token) and for `ray start --head` wherever a token exists (RAY_AUTH_TOKEN,
RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token): after any local Ray on a machine, the clusters started
there want the token. A driver connecting to an explicit address sends one only with
RAY_AUTH_MODE=token; Ray then takes RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names,
else ~/.ray/auth_token. Without it the cluster refuses every call, and `ray.init` retries for
20 s and says only "Failed to connect to Ray cluster".

rill keeps Ray's variables and adds one flag: `--ray-auth-token` (or RAY_AUTH_TOKEN) or
RAY_AUTH_TOKEN_PATH turns RAY_AUTH_MODE=token on in this process, unless RAY_AUTH_MODE is set
(Ray's switch wins); RAY_AUTH_MODE=token alone sends what Ray finds (~/.ray/auth_token). With
none of them no token is sent, as with Ray itself.

`check_cluster` then asks the cluster's GCS for its id through Ray's own gRPC channel (its TLS,
its token) and turns a refusal, no answer, or a cluster on the loopback address that Ray would
look for elsewhere into a `BackendError` that says what to do.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path

from frontend.backends import BackendError

MODE_VAR, TOKEN_VAR, TOKEN_PATH_VAR = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # 0: Ray keeps 127.0.0.1 (else it takes this host's address)
DEFAULT_TOKEN_FILE = Path.home() / ".ray" / "auth_token"
PROBE_TIMEOUT_S = 10.0
_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[^:/\[\]]+):(\d+)$")  # a GCS address; not "auto", not ray://
GET_TOKEN = "`ray get-auth-token` on the head node prints it"


def use_token(token: str | None) -> str | None:
    """Make this process's Ray send the cluster's token; returns where the token comes from (for
    messages), or None when no token will be sent. Raises BackendError for a token file that
    cannot be read (Ray would abort the process) or a token mode with no token anywhere."""
    token = token.strip() if token else None
    if token:
        os.environ[TOKEN_VAR] = token
    path = os.environ.get(TOKEN_PATH_VAR)
    if path and not os.environ.get(TOKEN_VAR):
        try:
            readable = bool(Path(path).read_text().strip())
        except OSError:
            readable = False
        if not readable:
            raise BackendError(f"{TOKEN_PATH_VAR} names {path}, which cannot be read or is empty: point it at the "
                               f"file holding the Ray cluster's token ({GET_TOKEN})")
    mode = os.environ.get(MODE_VAR, "").strip().lower()
    if not mode and (token or path):
        os.environ[MODE_VAR] = mode = "token"
    if mode != "token":
        return None
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")  # Ray caches its config (the auth mode with it) at import: read the variables again
    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()
    if not loader.has_token():
        raise BackendError(f"{MODE_VAR}=token is set but no Ray token was found: give the cluster's token with "
                           f"--ray-auth-token or {TOKEN_VAR}, or a file holding it with {TOKEN_PATH_VAR} "
                           f"({GET_TOKEN})")
    if os.environ.get(TOKEN_VAR):
        return f"--ray-auth-token or {TOKEN_VAR}"
    return f"the file {path} ({TOKEN_PATH_VAR})" if path else f"{DEFAULT_TOKEN_FILE} (Ray's default token file)"


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _loopback_kept() -> bool:
    """Whether this process's Ray keeps a loopback address (on Linux it replaces 127.0.0.1 with
    this host's address, unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0)."""
    from ray._private import ray_constants

    return not getattr(ray_constants, "ENABLE_RAY_CLUSTER", True)


def check_cluster(address: str, token_source: str | None) -> None:
    """Ask the GCS at `address` (host:port) whether it takes this process's token, and whether
    Ray will reach it there. Raises BackendError with what to do; returns when all is well or the
    address is not a plain host:port (`auto`, `ray://...`: Ray finds those itself)."""
    match = _HOST_PORT.match(address.strip())
    if not match:
        return
    import grpc
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    where = f"--ray-address {address}"
    with init_grpc_channel(address.strip()) as channel:  # Ray's channel: its TLS and, in token mode, its token
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=PROBE_TIMEOUT_S)
            nodes = stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNAUTHENTICATED and token_source:
                raise BackendError(f"{where}: the Ray cluster refused the token from {token_source}; give the "
                                   f"cluster's own token with --ray-auth-token or {TOKEN_VAR} ({GET_TOKEN})") from None
            if code == grpc.StatusCode.UNAUTHENTICATED:
                disabled = f" ({MODE_VAR}={os.environ[MODE_VAR]} is set)" if os.environ.get(MODE_VAR) else ""
                raise BackendError(f"{where}: the Ray cluster has token authentication on and rill sent no "
                                   f"token{disabled}; give its token with --ray-auth-token or {TOKEN_VAR}, or a "
                                   f"file holding it with {TOKEN_PATH_VAR} ({GET_TOKEN})") from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise BackendError(f"{where}: no Ray cluster answers there ({code.name}: "
                                   f"{(exc.details() or '').splitlines()[0][:200]}); start its head with "
                                   f"`ray start --head --port PORT`, or fix the address") from None
            return  # something else (an older GCS, a proxy): let ray.init say what it finds
    host = match.group(1)
    registered = sorted({node.node_manager_address for node in nodes.node_info_list})
    if _is_loopback(host) and registered and all(_is_loopback(ip) for ip in registered) and not _loopback_kept():
        raise BackendError(f"{where}: the Ray cluster runs on the loopback address ({', '.join(registered)}), "
                           f"and Ray replaces {host} with this host's network address unless {LOOPBACK_VAR}=0; "
                           f"set {LOOPBACK_VAR}=0 for app.py as for `ray start` (docs/scale-out.md)")
