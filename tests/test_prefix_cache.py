"""The prefix cache: a slot's cache outlives its request, and a prompt that starts with the tokens it holds runs
from where they end (Engine.resume), in the Python API (generate_stream), the scheduler (serve) and chat; the
answers are those of a prefill from an empty cache."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from runtime import Engine, GenerationStats, generate, generate_stream
from runtime.scheduler import FinishEvent, Job, Sampling, Scheduler, TokenEvent

WAIT_S = 60


def close(got: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max())


def test_resume_keeps_the_common_prefix_and_gives_a_cold_prefills_logits(tiny_sparse_artifact):
    engine, cold = Engine(tiny_sparse_artifact), Engine(tiny_sparse_artifact)
    first = [3, 1, 4, 1, 5, 9, 2, 6]
    engine.forward(first)
    engine.forward([7])  # a decoded token: the cache holds first + [7]
    for prompt, kept in (([3, 1, 4, 1, 5, 9, 2, 6, 7, 8, 8], 9),  # the whole history and more
                         ([3, 1, 4, 1, 50, 60], 4),  # a prompt that leaves the history after 4 tokens
                         ([3, 1, 4, 1], 3),  # a prefix of the history: its last token runs again
                         ([90, 91], 0)):  # nothing in common
        assert engine.prefix_length(prompt) == kept
        assert engine.resume(prompt) == kept
        assert engine.position == kept
        got = engine.forward(prompt[kept:], last_only=True, as_prompt=True)
        cold.reset()
        close(got, cold.forward(prompt, last_only=True))
        assert engine.position == len(prompt)


def test_reset_and_a_position_set_by_hand_forget_the_held_tokens(tiny_sparse_artifact):
    engine = Engine(tiny_sparse_artifact, slots=2)
    engine.forward([5, 6, 7, 8], slot=1)
    assert engine.prefix_length([5, 6, 7, 9], slot=1) == 3 and engine.prefix_length([5, 6, 7, 9], slot=0) == 0
    engine.reset(1)
    assert engine.prefix_length([5, 6, 7, 9], slot=1) == 0
    engine.forward([5, 6, 7, 8])
    engine.position = 2  # slot 0 holds [5, 6] now
    assert engine.prefix_length([5, 6, 7, 9]) == 2
    engine.position = 4  # positions 2 and 3 set by hand: their tokens unknown, never matched
    assert engine.prefix_length([5, 6, 7, 8, 1]) == 2


def test_generate_reuses_a_conversations_earlier_turns(tiny_sparse_artifact):
    engine = Engine(tiny_sparse_artifact)
    turn = [10, 11, 12, 13, 14]
    answer = generate(engine, turn, 6)["generated_ids"]
    # the next turn: the conversation so far (the answer's tokens fed back, its last one never decoded) and more
    second = turn + answer + [20, 21]
    stats = GenerationStats()
    got = list(generate_stream(engine, second, 6, stats=stats))
    assert stats.prompt_cached == len(turn) + len(answer) - 1
    assert got == generate(Engine(tiny_sparse_artifact), second, 6)["generated_ids"]


def run_jobs(scheduler: Scheduler, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy answer, one request after the other."""
    answers = []
    for prompt in prompts:
        tokens, done = [], threading.Event()

        def on_event(event, tokens=tokens, done=done):
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
            elif isinstance(event, FinishEvent):
                done.set()

        scheduler.submit(Job(prompt, Sampling(max_tokens), on_event))
        assert done.wait(WAIT_S)
        answers.append(tokens)
    return answers


@pytest.mark.parametrize("parallel", [1, 2])
def test_the_scheduler_gives_a_request_the_slot_holding_its_prefix(tiny_sparse_artifact, parallel):
    system = [30, 31, 32, 33, 34, 35, 36, 37]
    prompts = [system + [1, 2], [70, 71, 72], system + [3], system + [1, 2, 9]]
    scheduler = Scheduler(Engine(tiny_sparse_artifact, slots=parallel), queue_size=4)
    scheduler.start()
    try:
        answers = run_jobs(scheduler, prompts, 5)
    finally:
        scheduler.close()
    reference = Engine(tiny_sparse_artifact)
    assert answers == [generate(reference, p, 5)["generated_ids"] for p in prompts]
    stats = scheduler.stats()
    if parallel == 2:  # the other prompt went to the slot used least recently, so the system prompt's stayed for
        # the third request, and the fourth found the third's (the first's answer given up for it)
        assert stats.prefix_hits == 2 and stats.prompt_tokens_cached == 2 * len(system)
    else:  # one slot: the other prompt took it, the third request found nothing, the fourth the third's system
        assert stats.prefix_hits == 1 and stats.prompt_tokens_cached == len(system)
    assert stats.prompt_tokens == sum(map(len, prompts))
