"""`picompile serve` under load: total and per-request decode tokens/s and time to first token at 1, 2, 4, 8
concurrent requests.

An in-process server (uvicorn on 127.0.0.1, a free port) over one engine with as many slots as the largest
level; for each level P, P client threads each send `--requests` streamed completions of a `--prompt`-token
prompt for `--tokens` greedy tokens, back to back. Per request: time to first token (the first streamed
chunk), and decode tokens/s after it; per level: all tokens over the level's wall time. The running
requests decode in one batch step (runtime/scheduler.py; Engine.forward_batch), where the artifact has a
batch phase (`batched` below), so the total may grow with P while per-request speed falls more slowly than 1/P.

First, without the server: per batch size B, decode tokens/s of B slots stepped by forward_batch against the
same B slots stepped one decode step each, and the weight bytes read per token (the profile's: a sparse
layer's union of the B sequences' neurons is read once per batch step). Meant for small artifacts (the tiny
or small synthetic models); it runs every level on whatever artifact it is given.

Every request (and every slot in the engine figures) has its own random prompt, so the sequences of a batch
differ and a sparse layer's union is what real traffic makes. `--baseline` runs a second artifact (the dense
build of the same model) at every level, alternately with the first, and prints the first's speed-up over it.

`--load N` runs each server level twice, alternately, as it is and beside N busy processes (benchmarks/host.py's
BusyLoad, bounded in time), and prints the loaded total over the unloaded one; every table is followed by the
host's state (load, busy and stolen CPU, read bandwidth) while it was measured.

`--ray` then serves the first artifact through Ray Serve (runtime/ray_serve.py, the `ray` extra) on a local Ray
instance: for each replica count of `--ray-replicas` (default 1,2), replicas of `--threads` threads (default 1)
and ceil(max level / replicas) slots each, the same levels, beside the plain server's rows above; and the Ray
overhead per token at 1 request (1 replica against the plain server; like for like with `--threads 1`, which
the plain server's engine then uses too), taken over whole requests: Serve's proxy may pass a stream's chunks on
in bursts, so per-request tok/s after the first token reads high through Ray.

    python benchmarks/bench_serve.py model.pic [--baseline dense.pic] [--levels 1,2,4,8] [--requests 4]
        [--prompt 16] [--tokens 32] [--engine-steps 16] [--no-server] [--load N] [--threads N]
        [--ray [--ray-replicas 1,2] [--ray-port 8000]]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.host import BusyLoad, HostState  # noqa: E402
from runtime import Engine  # noqa: E402
from runtime.serve import bind, create_app, make_server  # noqa: E402


def streamed_request(http: httpx.Client, url: str, prompt: list[int], tokens: int) -> dict:
    """One streamed greedy completion: seconds to the first token, seconds in all, tokens received."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    began, first, received = time.perf_counter(), None, 0
    with http.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[len("data: "):])["choices"][0]["token_ids"]
            if ids and first is None:
                first = time.perf_counter()
            received += len(ids)
    return {"ttft_s": first - began, "total_s": time.perf_counter() - began, "tokens": received,
            "decode_s": time.perf_counter() - first}


def distinct_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`count` different random prompts: sequences of a batch that were one prompt would select the same neurons,
    and a sparse layer's union would then cost no more than one sequence's selection."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(count)]


def run_level(engine, parallel: int, requests: int, prompts: list[list[int]], tokens: int) -> dict:
    """P clients (`parallel`) of an in-process server of `engine` with P slots: drive()."""
    sock = bind("127.0.0.1", 0)
    server = make_server(create_app(engine, tokenizer=None, parallel=parallel, queue=parallel * requests),
                         log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        return drive(f"http://127.0.0.1:{sock.getsockname()[1]}", parallel, requests, prompts, tokens)
    finally:
        server.should_exit = True
        thread.join()
        sock.close()


def drive(url: str, parallel: int, requests: int, prompts: list[list[int]], tokens: int) -> dict:
    """P clients (`parallel`), each sending `requests` streamed completions back to back, client c's r-th of
    prompts[c * requests + r]."""
    with httpx.Client() as http:
        streamed_request(http, url, prompts[-1], 2)  # warm: the first request pays for the first prefill

    def client(c):  # a client keeps its connection, as real ones do
        with httpx.Client() as http:
            return [streamed_request(http, url, prompts[c * requests + r], tokens) for r in range(requests)]

    began = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        results = [r for rs in pool.map(client, range(parallel)) for r in rs]
    wall = time.perf_counter() - began
    per_request = [(r["tokens"] - 1) / r["decode_s"] for r in results if r["tokens"] > 1 and r["decode_s"] > 0]
    ttft = sorted(r["ttft_s"] for r in results)
    return {"parallel": parallel, "requests": len(results), "total_tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "per_request_tokens_per_s": statistics.median(per_request) if per_request else 0.0,
            "ttft_median_ms": statistics.median(ttft) * 1000, "ttft_p90_ms": ttft[math.ceil(0.9 * len(ttft)) - 1] * 1000,  # nearest rank
            "request_ms_per_token": statistics.median(r["total_s"] / r["tokens"] for r in results) * 1000}


def engine_level(engine, batch: int, steps: int, prompts: list[list[int]]) -> dict:
    """Tokens/s and weight bytes per token of `steps` batch steps of `batch` slots, then of the same slots
    stepped one decode step each (slot i after a prefill of prompts[i])."""
    slots = list(range(batch))
    result = {"batch": batch}
    for mode in ("batched", "per_slot"):
        tokens = {}
        for slot in slots:
            engine.reset(slot)
            tokens[slot] = int(engine.forward(prompts[slot], slot)[-1].argmax())
        began = None
        for step in range(steps + 1):  # the first untimed: it binds the batch program
            if step == 1:
                engine.profile, began = {}, time.perf_counter()
            ids = [tokens[slot] for slot in slots]
            if mode == "batched":
                logits = engine.forward_batch(ids, slots)
            else:
                logits = [engine.forward([token], slot)[0] for token, slot in zip(ids, slots)]
            tokens = {slot: int(row.argmax()) for slot, row in zip(slots, logits)}
        seconds = time.perf_counter() - began
        result[f"{mode}_tokens_per_s"] = batch * steps / seconds
        result[f"{mode}_bytes_per_token"] = engine.profile.get("weight_bytes", 0) / (batch * steps)
        engine.profile = None
    return result


ENGINE_COLUMNS = ("batch", "batched tok/s", "per-slot tok/s", "batched/per-slot", "batched MB/tok", "per-slot MB/tok")
SERVER_COLUMNS = ("parallel", "requests", "total tok/s", "per-request tok/s", "TTFT median ms", "TTFT p90 ms")


def engine_cells(row: dict) -> list[str]:
    return [f"{row['batched_tokens_per_s']:.1f}", f"{row['per_slot_tokens_per_s']:.1f}",
            f"{row['batched_tokens_per_s'] / row['per_slot_tokens_per_s']:.2f}x",
            f"{row['batched_bytes_per_token'] / 1e6:.1f}", f"{row['per_slot_bytes_per_token'] / 1e6:.1f}"]


def server_cells(row: dict) -> list[str]:
    return [str(row["requests"]), f"{row['total_tokens_per_s']:.1f}", f"{row['per_request_tokens_per_s']:.1f}",
            f"{row['ttft_median_ms']:.0f}", f"{row['ttft_p90_ms']:.0f}"]


def table(columns, rows) -> str:
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---:" for _ in columns) + " |"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--baseline", help="a second artifact (e.g. the dense build of the same model), run at "
                                           "every level alternately with the first; the ratios are artifact / baseline")
    parser.add_argument("--levels", default="1,2,4,8", help="concurrent requests per level, comma-separated")
    parser.add_argument("--requests", type=int, default=4, help="requests each client sends, one after another")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--engine-steps", type=int, default=16, help="decode steps per batch size, without the server")
    parser.add_argument("--no-server", action="store_true", help="only the engine's figures")
    parser.add_argument("--load", type=int, default=0, help="also run each server level beside N busy processes")
    parser.add_argument("--threads", type=int, default=None,
                        help="kernel threads of every engine (default: measured as it runs; Ray replicas: 1)")
    parser.add_argument("--ray", action="store_true", help="also serve the first artifact through Ray Serve replicas")
    parser.add_argument("--ray-replicas", default="1,2", help="replica counts for --ray, comma-separated")
    parser.add_argument("--ray-port", type=int, default=8000, help="Ray Serve's HTTP port on 127.0.0.1")
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",")]
    names = [args.artifact] + ([args.baseline] if args.baseline else [])
    engines = {name: Engine(name, slots=max(levels), threads=args.threads) for name in names}
    first = engines[args.artifact]
    if any(engine.vocab_size != first.vocab_size for engine in engines.values()):
        parser.error("--baseline must be an artifact of a model with the same vocabulary")
    if args.prompt + args.tokens > min(engine.max_context for engine in engines.values()):
        parser.error("--prompt + --tokens exceed an artifact's max context")
    prompts = distinct_prompts(max(levels) * args.requests + 1, args.prompt, first.vocab_size)
    for name, engine in engines.items():
        print(f"{name}: batched {engine.batched} (max batch {engine.max_batch})")
    print(f"\nWithout the server: per batch size, {args.engine_steps} decode steps after a {args.prompt}-token prompt "
          "(a different one per slot)")
    measure(names, levels, lambda name, batch: engine_level(engines[name], batch, args.engine_steps, prompts),
            ENGINE_COLUMNS, engine_cells, "batched_tokens_per_s", "batched decode tok/s per batch size")
    if args.no_server:
        return
    print(f"\nThrough the server: prompts of {args.prompt} tokens (all different), {args.tokens} generated per request, "
          f"{args.requests} requests per client")
    serve = lambda name, parallel: run_level(engines[name], parallel, args.requests, prompts, args.tokens)  # noqa: E731
    if not args.load:
        state = HostState.before()
        rows = measure(names, levels, serve, SERVER_COLUMNS, server_cells, "total_tokens_per_s",
                       "total tok/s through the server per parallel requests")
        print(state.after().summary())
        if args.ray:
            engines.clear()  # the replicas load their own
            ray_levels(args, levels, prompts, rows[args.artifact])
        return
    loaded = {}

    def alternated(name, parallel):  # unloaded, then loaded, at each level
        row = serve(name, parallel)
        with BusyLoad(args.load, seconds=600):
            state = HostState.before(load_processes=args.load)
            loaded[name, parallel] = serve(name, parallel) | {"host": state}
            state.after()
        return row

    state = HostState.before()
    rows = measure(names, levels, alternated, SERVER_COLUMNS, server_cells, "total_tokens_per_s",
                   "total tok/s through the server per parallel requests")
    print(state.after().summary() + " (over the unloaded and loaded runs together)")
    for name in names:
        print(f"\n{name} beside {args.load} busy process(es)\n" + table(
            SERVER_COLUMNS, [[str(level), *server_cells(loaded[name, level])] for level in levels]))
        for level in levels:
            row = loaded[name, level]
            unloaded = next(r for r in rows[name] if r["parallel"] == level)
            print(f"- {level} parallel: loaded total / unloaded total **{row['total_tokens_per_s'] / unloaded['total_tokens_per_s']:.2f}x**"
                  f" (target >= 0.45 at 4); {row['host'].summary()}")


def ray_levels(args, levels: list[int], prompts: list[list[int]], plain: list[dict]) -> None:
    """The levels through Ray Serve, per replica count; then the Ray overhead per token at 1 request."""
    from runtime import ray_serve

    threads = args.threads or 1
    counts = [int(count) for count in args.ray_replicas.split(",")]
    ray_serve.start_local("127.0.0.1", args.ray_port, cpus=max(os.cpu_count() or 1, max(counts) * threads))
    url = f"http://127.0.0.1:{args.ray_port}"
    rows = {}
    try:
        for count in counts:
            deployment = ray_serve.Deployment(
                os.path.abspath(args.artifact), parallel=math.ceil(max(levels) / count),
                queue=max(levels) * args.requests, threads=threads, replicas=count, replica_cpus=float(threads),
                code_path=os.path.join(HERE, ".."))
            ray_serve.deploy(deployment, tokenizer=None)
            state = HostState.before()
            rows[count] = [drive(url, level, args.requests, prompts, args.tokens) for level in levels]
            print(f"\n{args.artifact} through Ray Serve: {count} replica(s) of {threads} thread(s) and "
                  f"{deployment.parallel} slots\n" + table(SERVER_COLUMNS, [[str(level), *server_cells(row)]
                                                                       for level, row in zip(levels, rows[count])]))
            print(state.after().summary())
    finally:
        ray_serve.stop(local=True)
    if 1 in rows and 1 in levels:
        # over whole requests: Serve's proxy may pass a stream's chunks on in bursts, which per-request tok/s after
        # the first token would count as speed
        ray, base = rows[1][levels.index(1)], plain[levels.index(1)]
        overhead = ray["request_ms_per_token"] - base["request_ms_per_token"]
        print(f"\nRay overhead at 1 request (1 replica against the plain server): {overhead:+.2f} ms per token "
              f"(a whole request's time over its tokens: {ray['request_ms_per_token']:.2f} against "
              f"{base['request_ms_per_token']:.2f}), time to first token {ray['ttft_median_ms'] - base['ttft_median_ms']:+.0f} ms"
              + ("" if args.threads else " (engines of different threads: give --threads 1 for like with like)"))
    for count in counts[1:]:
        if counts[0] in rows:
            print(f"{count} replicas over {counts[0]}, total tok/s: " + ", ".join(
                f"{level}: {row['total_tokens_per_s'] / first['total_tokens_per_s']:.2f}x"
                for level, row, first in zip(levels, rows[count], rows[counts[0]])))


def measure(names: list[str], levels: list[int], run, columns, cells, speed: str, what: str) -> dict[str, list[dict]]:
    """`run(name, level)` for every level, the baseline (names[1], if any) first at each, then a table per artifact
    and the first's speed-up over the baseline in `speed`."""
    rows = {name: [] for name in names}
    for level in levels:
        for name in names[::-1]:
            rows[name].append(run(name, level))
    for name in names:
        print(f"\n{name}\n" + table(columns, [[str(level), *cells(row)] for level, row in zip(levels, rows[name])]))
    if len(names) > 1:
        print(f"\n{names[0]} over {names[1]}, {what}: " + ", ".join(
            f"{level}: {row[speed] / base[speed]:.2f}x" for level, row, base in zip(levels, rows[names[0]], rows[names[1]])))
    return rows


if __name__ == "__main__":
    main()
