"""`picompile serve --ray`: runtime/serve.py's server as the replicas of a Ray Serve application.

Each replica loads the artifact and runs `create_app`'s app: its own engine, slots, batching and scheduler, and the
same routes, fields, errors, streaming and metrics as `picompile serve`. Serve's HTTP proxy hands every request to
the application's front (`Front`, one light replica), which relays it to an engine replica through a deployment
handle as a stream of ASGI messages (runtime/relay.py); Serve's router spreads them over the replicas, adds and
removes replicas as the ongoing requests per replica pass `parallel` (the slots of one), and replaces a replica
that dies or whose scheduler stopped (`check_health`). A request on a replica that dies ends with the project's
error body (503 `engine_unavailable`, Retry-After; a stream that had started: that body as its last event, then
[DONE]), never a hang; the others' requests go on. /health and /metrics answer from one replica and add the
deployment's replicas by state (serve.ReplicaSet).

Ray (`ray[serve]`) is the optional `ray` extra; only `picompile serve --ray` (and a Serve config file's
`import_path: runtime.ray_serve:build`) import this module, so `import runtime` never imports ray.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import ray
from ray import serve

from .gate import Policy
from .relay import AppLifespan, Relay, asgi_messages
from .serve import FROM_ARTIFACT, ReplicaSet, create_app

APP_NAME = "picompile"  # the Serve application, and its engine replicas' deployment
FRONT_NAME = "picompile-front"  # the deployment that takes the HTTP requests and relays them to the replicas
FRONT_ONGOING_REQUESTS = 1000  # the front's own bound: each replica's gate and queue bound what it admits
ARTIFACT_TOKENIZER = "artifact"  # Replica's default tokenizer: the artifact's own (a string: it crosses pickling)
OBJECT_STORE_BYTES = 100 * 2**20  # a local instance's object store: requests and answers are small
HEALTH_CHECK_PERIOD_S = 2.0  # how soon Serve notices a replica whose scheduler stopped


@dataclass(frozen=True)
class Deployment:
    """What `serve --ray` deploys: the artifact as `picompile serve` serves it, times the replicas.
    `replicas` fixes their count; otherwise Serve autoscales between `min_replicas` and `max_replicas`,
    aiming at `parallel` ongoing requests per replica (its slots full)."""

    artifact: str  # a path every node of the cluster can read
    parallel: int = 1
    queue: int = 16
    prefill_chunk: int | None = None  # prompt tokens prefilled a step (None: the scheduler's default)
    threads: int | None = None  # kernel threads per replica (None: the replica's CPUs)
    replicas: int | None = 1
    min_replicas: int = 1
    max_replicas: int | None = None
    replica_cpus: float = 1.0  # the CPUs Ray reserves for each replica
    model_id: str | None = None
    code_path: str | None = None  # a directory holding this `runtime` package, put on the replicas' PYTHONPATH
    policy: Policy = Policy()  # each replica's keys and limits (its gate: runtime/gate.py)

    def options(self) -> dict:
        """serve.deployment options."""
        scaling = ({"num_replicas": self.replicas} if self.replicas is not None else {"autoscaling_config": {
            "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.parallel}})
        actor = {"num_cpus": self.replica_cpus}
        if self.code_path is not None:
            path = os.pathsep.join(p for p in (self.code_path, os.environ.get("PYTHONPATH")) if p)
            actor["runtime_env"] = {"env_vars": {"PYTHONPATH": path}}
        # a replica admits its slots and its queue (answering 429 past them, as `picompile serve`), and a few
        # more for /health and /metrics while it is full
        return {**scaling, "ray_actor_options": actor, "max_ongoing_requests": self.parallel + self.queue + 4,
                "health_check_period_s": HEALTH_CHECK_PERIOD_S, "max_constructor_retry_count": 2}


@serve.deployment(name=APP_NAME)
class Replica:
    """One replica: the artifact's engine behind runtime/serve.py's app, started with the replica (its lifespan:
    the scheduler) and stopped with it; the front relays requests to it (`http`)."""

    async def __init__(self, artifact: str, parallel: int = 1, queue: int = 16, threads: int | None = None,
                       model_id: str | None = None, tokenizer=ARTIFACT_TOKENIZER, policy: Policy = Policy(),
                       prefill_chunk: int | None = None):
        self._artifact, self._threads = artifact, threads
        tokenizer = FROM_ARTIFACT if tokenizer == ARTIFACT_TOKENIZER else tokenizer
        self._app = create_app(self.load_engine(parallel), tokenizer=tokenizer, parallel=parallel, queue=queue,
                               model_id=model_id or Path(artifact).name, replica_set=self._replica_set,
                               policy=policy, prefill_chunk=prefill_chunk)
        self.app = _NamingReplica(self._app, serve.get_replica_context().replica_id.unique_id)
        self._lifespan = AppLifespan(self.app)
        await self._lifespan.startup()

    async def __del__(self):
        await self._lifespan.shutdown()

    def load_engine(self, slots: int):
        from .engine import Engine

        return Engine(self._artifact, slots=slots, threads=self._threads)

    async def _replica_set(self) -> ReplicaSet:
        context = serve.get_replica_context()
        status = await asyncio.to_thread(serve.status)  # a call to Serve's controller
        deployment = status.applications[context.app_name].deployments[context.deployment]
        return ReplicaSet(context.replica_id.unique_id, str(deployment.status.value),
                          {str(getattr(state, "value", state)): count
                           for state, count in deployment.replica_states.items()})

    def check_health(self):
        """Serve's periodic check: a replica whose scheduler thread stopped is replaced."""
        if not self._app.state.endpoints.scheduler.stepping:
            raise RuntimeError("the replica's scheduler stopped")

    async def http(self, scope: dict, body: bytes):
        """One HTTP request the front relays: the ASGI messages this replica's app answers it with."""
        async for message in asgi_messages(self.app, scope, body):
            yield message


@serve.deployment(name=FRONT_NAME)
@serve.ingress()
class Front:
    """The application's ingress: each request relayed to an engine replica (`Replica.http`), a replica's death
    answered with the project's error body (runtime/relay.py)."""

    def __init__(self, replicas, max_body_bytes: int):
        self._replicas, self._max_body_bytes = replicas, max_body_bytes

    def __serve_build_asgi_app__(self):
        return Relay(self._call, self._max_body_bytes)

    async def _call(self, scope: dict, body: bytes):
        stream = self._replicas.options(stream=True).http.remote(scope, body)
        try:
            async for message in stream:
                yield message
        finally:  # (a client that left: its replica's request is cancelled too)
            stream.cancel()


class _NamingReplica:
    """The app, its answers naming the replica that gave them (header x-picompile-replica): which one held
    a request that failed."""

    def __init__(self, app, replica: str):
        self.app, self.state, self._header = app, app.state, (b"x-picompile-replica", replica.encode())

    async def __call__(self, scope, receive, send):
        async def named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        await self.app(scope, receive, named if scope["type"] == "http" else send)


def application(deployment: Deployment, tokenizer=ARTIFACT_TOKENIZER, replica=None):
    """The Serve application: `deployment`'s replicas. `tokenizer`: the artifact's (default), None (token ids
    only) or an object with runtime.text.TextTokenizer's interface (pickled to each replica). `replica`: the
    deployment class, Replica's or a subclass of `Replica.func_or_class` (say, one whose load_engine wraps
    the engine)."""
    replica = Replica if replica is None else serve.deployment(replica, name=APP_NAME)
    replicas = replica.options(**deployment.options()).bind(
        deployment.artifact, deployment.parallel, deployment.queue, deployment.threads, deployment.model_id,
        tokenizer, deployment.policy, deployment.prefill_chunk)
    return Front.options(num_replicas=1, ray_actor_options={"num_cpus": 0},
                         max_ongoing_requests=FRONT_ONGOING_REQUESTS).bind(replicas, deployment.policy.max_body_bytes)


def build(args: dict):
    """A Serve config file's application builder (`import_path: runtime.ray_serve:build`): `args` are
    Deployment's fields (artifact, parallel, queue, prefill_chunk, threads, replicas, min_replicas, max_replicas,
    replica_cpus, model_id, policy: a mapping of Policy's fields); the config file's `deployments:` entry may
    override the scaling."""
    known = set(asdict(Deployment(artifact="")))
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown picompile deployment argument(s) {', '.join(unknown)}; known: {sorted(known)}")
    if "policy" in args:
        policy = dict(args["policy"])
        policy["api_keys"] = frozenset(policy.get("api_keys", ()))
        policy["cors_origins"] = tuple(policy.get("cors_origins", ()))
        args = {**args, "policy": Policy(**policy)}
    return application(Deployment(**args))


def start_local(host: str, port: int, cpus: float) -> None:
    """A Ray instance of this process on the loopback (no dashboard, a small object store, `cpus` CPUs) and
    Serve's HTTP proxy on host:port."""
    ray.init(address="local", include_dashboard=False, num_cpus=cpus, object_store_memory=OBJECT_STORE_BYTES,
             _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": host, "port": port})


def connect(address: str, host: str, port: int) -> None:
    """An existing Ray cluster (a `ray start --head` address, or ray://), Serve's proxies on host:port
    where Serve is not running there yet."""
    ray.init(address=address, log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": host, "port": port})


def deploy(deployment: Deployment, tokenizer=ARTIFACT_TOKENIZER, replica=None) -> None:
    """Run the application at route / (replacing an earlier picompile application); returns once its replicas
    are up, or raises RuntimeError with Serve's reason."""
    serve.run(application(deployment, tokenizer, replica), name=APP_NAME, route_prefix="/")


def stop(local: bool) -> None:
    """Remove the application; with a local instance, Serve and Ray too."""
    if local:
        serve.shutdown()
        ray.shutdown()
    else:
        serve.delete(APP_NAME)
