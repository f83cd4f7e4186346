"""A model split across machines (`build --nodes`), run as one Ray actor per stage: `run` and `serve` of a split artifact.

Each stage is a `StageActor` holding `Engine(directory, stage=k)`: its own calls, buffers, weights, KV caches and
slots. It asks Ray for one CPU (and one GPU where its node has a card: `Stage.gpu_bytes`) and its stage's
`resources` (the manifest's `Stage.resources`, e.g. {"picompile_stage1": 1}), so that Ray places it on the node
that offers them, and is restarted by Ray (`max_restarts`) when it dies, with empty caches.

`Pipeline` has the Engine interface `runtime/scheduler.py`, `runtime/sampling.py` and `runtime/serve.py` use
(forward, forward_batch, reset, slots, positions, vocab_size, max_context, directory, manifest, profile). A step
chains the stages with ObjectRefs: stage k+1's call takes stage k's result ref, so the hidden rows go from actor to
actor through Ray's object store without passing through this process, and only the last stage's logits come back.
`forward_batch` splits its slots into one micro-batch per stage and submits every micro-batch's chain before it
waits: while stage 1 runs the first micro-batch, stage 0 runs the second (concurrent requests' tokens overlap
across the stages). One request's tokens do not: each decode step needs the token the last stage chose.

A stage that dies (or a step that outlasts `step_timeout_s`: every wait is bounded) fails the step that was in
flight with `StageFailed`; the scheduler ends the requests of that step with an error, the server answers them
with an OpenAI-style error and goes on serving. Every slot's context is then lost (the restarted stage's caches
are empty): a slot must be `reset` (a new request's prefill) before it is used again.

Ray (`ray[serve]`, the `ray` extra) is imported only by this module, which only `run` / `serve` of a split artifact
import: `import runtime` never imports ray.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import ray
from ray import exceptions as ray_errors

from .artifact import ArtifactError, first_line, load_manifest
from .scheduler import EngineUnavailable

STEP_TIMEOUT_S = 300.0  # the longest a step may wait for the stages (a long prompt's prefill on a slow node)
START_TIMEOUT_S = 300.0  # ... and for every stage to load its part at start (Ray placing it, reading its weights)
MAX_RESTARTS = 10  # times Ray restarts a stage that died
OBJECT_STORE_BYTES = 100 * 2**20  # a local instance's object store: hidden rows and logits are small


class StageFailed(EngineUnavailable):
    """A stage died or did not answer in time: the step in flight failed, and the slots' contexts are lost."""


class ContextLost(RuntimeError):
    """A stage was asked to go on from a position its caches do not hold: Ray restarted it (empty caches) between
    two steps of a request."""


@ray.remote(max_restarts=MAX_RESTARTS, max_task_retries=0)
class StageActor:
    """One stage of a split artifact: `Engine(directory, stage=k)`."""

    def __init__(self, directory: str, stage: int, slots: int, threads: int | None, emulate_gpu: bool = False):
        from .engine import Engine

        self.engine = Engine(directory, stage=stage, slots=slots, threads=threads, emulate_gpu=emulate_gpu)

    def where(self) -> dict:
        """Where the stage runs (its process and Ray node), once its engine has loaded."""
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    def forward(self, inputs, slot: int, position: int, as_prompt: bool = False):
        self._check(slot, position)
        return self.engine.forward_stage(inputs, slot, as_prompt=as_prompt)

    def forward_batch(self, inputs, slots: list[int], positions: list[int]):
        for slot, position in zip(slots, positions):
            self._check(slot, position)
        return self.engine.forward_stage_batch(inputs, slots)

    def _check(self, slot: int, position: int) -> None:
        if self.engine.positions[slot] != position:
            raise ContextLost(f"slot {slot} holds {self.engine.positions[slot]} tokens here, the pipeline {position}: "
                              "this stage was restarted")

    def reset(self, slot: int) -> None:
        self.engine.reset(slot)

    def hold_caches(self) -> int:
        return self.engine.hold_caches()


class Pipeline:
    """A split artifact's stages as Ray actors, behind the Engine interface (see the module's docstring). Ray must
    be initialised (`start_local` or `connect`)."""

    def __init__(self, directory: str | Path, *, slots: int = 1, threads: int | None = 1,
                 step_timeout_s: float = STEP_TIMEOUT_S, start_timeout_s: float = START_TIMEOUT_S,
                 code_path: str | None = None, emulate_gpu: bool = False):
        self.directory = Path(directory).resolve()
        self.manifest = load_manifest(self.directory, check_hashes=False)  # each stage checks its own files
        if not self.manifest.stages:
            raise ArtifactError(f"{directory} is not split across machines (built without --nodes): run it as one engine")
        self.stages = self.manifest.stages
        self.slots, self.step_timeout_s = slots, step_timeout_s
        self.max_context = self.manifest.model.max_context
        self.prefill_chunk = self.max_context  # (a step takes a whole prompt: each stage's engine splits it as it must)
        self.vocab_size = self.manifest.model.vocab_size  # (each stage's engine checks it against its files)
        self.positions = [0] * slots
        self.profile = None  # (the stages' kernels are not profiled from here)
        self._lost: set[int] = set()  # slots whose caches a stage that died took with it, until reset
        options = {}
        if code_path is not None:  # the actors import this `runtime` package, not an installed one
            path = os.pathsep.join(p for p in (code_path, os.environ.get("PYTHONPATH")) if p)
            options["runtime_env"] = {"env_vars": {"PYTHONPATH": path}}
        # a stage placed on its node's card asks Ray for one GPU (emulated: its GPU part runs on the actor's CPU)
        self.actors = [StageActor.options(num_cpus=1, num_gpus=0 if emulate_gpu or not stage.gpu_bytes else 1,
                                          resources=dict(stage.resources), **options)
                       .remote(str(self.directory), index, slots, threads, emulate_gpu)
                       for index, stage in enumerate(self.stages)]
        self.start_timeout_s = start_timeout_s
        self._failed = False  # a stage failed: wait for Ray to have restarted it before the next step
        self.where = self._wait([actor.where.remote() for actor in self.actors], start_timeout_s, "start")

    # ---------------------------------------------------------------- the Engine interface

    def reset(self, slot: int = 0) -> None:
        slot = self._slot(slot)
        self._recover()
        for actor in self.actors:  # ordered before this caller's next calls to each actor
            actor.reset.remote(slot)
        self.positions[slot] = 0
        self._lost.discard(slot)

    def hold_caches(self) -> int:
        """`Engine.hold_caches` on every stage: the bytes of their caches, now resident."""
        return sum(self._wait([actor.hold_caches.remote() for actor in self.actors], self.step_timeout_s, "hold caches"))

    def prefix_length(self, prompt_ids, slot: int = 0) -> int:
        """0: a pipeline keeps no prompt's prefix between requests (its stages' caches are resumed from none)."""
        self._slot(slot)
        return 0

    def resume(self, prompt_ids, slot: int = 0) -> int:
        """`Engine.resume` of a pipeline: the slot reset, nothing kept (`prefix_length`)."""
        self.reset(slot)
        return 0

    def forward(self, token_ids, slot: int = 0, last_only: bool = False, as_prompt: bool = False) -> np.ndarray:
        """New tokens of one slot through every stage: their logits [len, vocab] (`last_only`: the last row's
        alone [1, vocab], as `Engine.forward` returns it; the last stage computes every row's here)."""
        slot = self._slot(slot)
        ids = self._ids(token_ids, [slot])
        if ids.size == 0:
            raise ValueError("forward needs at least one token")
        self._check_room([slot], ids.size)
        self._recover()
        logits = self._wait(self._chain(ids, slot, as_prompt), self.step_timeout_s, "step")
        self.positions[slot] += ids.size
        return logits[-1:] if last_only else logits

    def forward_batch(self, token_ids, slots) -> np.ndarray:
        """One new token for each of `slots`: their logits [len(slots), vocab]. The slots go through the stages in
        one micro-batch per stage, every chain submitted before any is waited for, so the stages overlap."""
        slots = [self._slot(slot) for slot in slots]
        ids = self._ids(token_ids, slots)
        if ids.size != len(slots) or not slots or len(set(slots)) != len(slots):
            raise ValueError(f"forward_batch takes one token id per slot, slots distinct: {ids.size} ids for {slots}")
        self._check_room(slots, 1)
        self._recover()
        count = min(len(slots), len(self.actors))
        bounds = [round(i * len(slots) / count) for i in range(count + 1)]
        refs = [self._chain(ids[a:b], slots[a:b]) for a, b in zip(bounds, bounds[1:])]
        logits = np.concatenate(self._wait(refs, self.step_timeout_s, "step"))
        for slot in slots:
            self.positions[slot] += 1
        return logits

    # ---------------------------------------------------------------- inside

    def _chain(self, ids: np.ndarray, slot, as_prompt: bool = False):
        """The stages' calls for one step, each taking the one before's result (an ObjectRef): the last's ref."""
        ref = ids
        if isinstance(slot, list):
            positions = [self.positions[s] for s in slot]
            for actor in self.actors:
                ref = actor.forward_batch.remote(ref, slot, positions)
            return ref
        for actor in self.actors:
            ref = actor.forward.remote(ref, slot, self.positions[slot], as_prompt)
        return ref

    def _wait(self, refs, timeout_s: float, what: str):
        """ray.get, bounded: a stage that died or does not answer is a StageFailed (every slot's context is then
        lost); an error the engine raised (a full context, a bad token id) is raised as it was."""
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray_errors.RayTaskError as error:  # the engine refused the step (before any stage changed a cache)
            cause = error.cause if isinstance(error.cause, Exception) else None
            if isinstance(cause, (ValueError, ArtifactError)):
                raise type(cause)(str(cause)) from None
            self._lose_all()
            if isinstance(cause, ContextLost):
                raise StageFailed(f"a stage of the split model was restarted and lost its caches ({cause}): the "
                                  "requests of this step fail") from None
            raise StageFailed(f"a stage failed the {what}: {first_line(error, type(error).__name__)}") from None
        except (ray_errors.RayActorError, ray_errors.GetTimeoutError, ray_errors.ObjectLostError) as error:
            self._lose_all()
            if what == "start":
                raise StageFailed(f"the stages did not all start within {timeout_s:g} s "
                                  f"({first_line(error, type(error).__name__)}); "
                                  f"each needs a Ray node with 1 CPU (and a GPU where its node has a card) and its "
                                  f"resources: "
                                  f"{[stage.resources for stage in self.stages]}") from None
            what = (f"did not answer within {timeout_s:g} s" if isinstance(error, ray_errors.GetTimeoutError) else
                    f"died ({type(error).__name__})")
            raise StageFailed(f"a stage of the split model {what}: the requests of this step fail, and Ray restarts "
                              "the stage with empty caches") from None

    def _lose_all(self) -> None:
        self._lost.update(range(self.slots))
        self._failed = True

    def _recover(self) -> None:
        """After a failure: wait (bounded) until every stage answers again, Ray having restarted the dead one (a
        call to a stage while it restarts fails at once)."""
        if not self._failed:
            return
        deadline = time.monotonic() + self.start_timeout_s
        for index, actor in enumerate(self.actors):
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StageFailed(f"stage {index} ({self.stages[index].name}) did not come back within "
                                      f"{self.start_timeout_s:g} s of failing")
                try:
                    ray.get(actor.where.remote(), timeout=left)
                    break
                except ray_errors.ActorUnavailableError:  # restarting
                    time.sleep(0.05)
                except ray_errors.RayActorError as error:  # dead for good (its restarts used up)
                    raise StageFailed(f"stage {index} ({self.stages[index].name}) is dead and Ray will not restart "
                                      f"it again ({first_line(error, type(error).__name__)})") from None
                except ray_errors.GetTimeoutError:
                    continue
        self._failed = False

    def _check_room(self, slots: list[int], rows: int) -> None:
        for slot in slots:
            if slot in self._lost and self.positions[slot]:
                raise StageFailed(f"slot {slot}'s context was lost when a stage restarted: reset it first")
            if self.positions[slot] + rows > self.max_context:
                raise ValueError(f"context full: slot {slot} holds {self.positions[slot]} tokens + {rows} new > max "
                                 f"context {self.max_context}")

    def _slot(self, slot) -> int:
        if not isinstance(slot, (int, np.integer)) or isinstance(slot, bool) or not 0 <= slot < self.slots:
            raise ValueError(f"slot must be in [0, {self.slots}); got {slot!r}")
        return int(slot)

    def _ids(self, token_ids, slots) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}); got {ids.min()}..{ids.max()}")
        return ids

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


def start_local(stages, cpus: int | None = None) -> None:
    """A Ray instance of this process on the loopback offering every stage's resources, so that all stages run on
    this machine (`run` / `serve` of a split artifact without --address)."""
    resources: dict[str, float] = {}
    for stage in stages:
        for name, amount in stage.resources.items():
            resources[name] = resources.get(name, 0) + amount
    ray.init(address="local", include_dashboard=False, num_cpus=cpus or max(len(stages), os.cpu_count() or 1),
             resources=resources, object_store_memory=OBJECT_STORE_BYTES, _node_ip_address="127.0.0.1",
             log_to_driver=False, configure_logging=False)


def connect(address: str) -> None:
    """An existing Ray cluster (a `ray start --head` address, or ray://) whose nodes offer the stages' resources."""
    ray.init(address=address, log_to_driver=False, configure_logging=False)


def stop() -> None:
    ray.shutdown()
