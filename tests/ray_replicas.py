"""A Serve replica for tests/test_ray_serve.py whose engine steps take a while, so that a request is still
running when the test kills its replica. Pickled by value to the replicas (tests/ is not on their path)."""

from __future__ import annotations

import time

from runtime.ray_serve import Replica

STEP_S = 0.05  # each engine step sleeps this long: a 40-token request runs ~2 s


class SlowEngine:
    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def forward(self, token_ids, slot: int = 0, **options):
        time.sleep(STEP_S)
        return self._engine.forward(token_ids, slot, **options)

    def forward_batch(self, token_ids, slots):
        time.sleep(STEP_S)
        return self._engine.forward_batch(token_ids, slots)


class SlowReplica(Replica.func_or_class):
    def load_engine(self, slots: int):
        return SlowEngine(super().load_engine(slots))
