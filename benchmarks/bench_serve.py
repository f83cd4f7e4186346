"""`picompile serve` under load: total and per-request decode tokens/s and time to first token at 1, 2, 4, 8
concurrent requests.

An in-process server (uvicorn on 127.0.0.1, a free port) over one engine with as many slots as the largest
level; for each level P, P client threads each send `--requests` streamed completions of a `--prompt`-token
prompt for `--tokens` greedy tokens, back to back. Per request: time to first token (the first streamed
chunk), and decode tokens/s after it; per level: all tokens over the level's wall time. The slots' steps
run one after another (batch-1 programs, see runtime/scheduler.py), so the total is expected to stay near
one sequence's decode speed while per-request speed falls as 1/P; what P buys is that requests no longer
wait for each other to finish. Meant for small artifacts (the tiny or small synthetic models); it runs
every level on whatever artifact it is given.

    python benchmarks/bench_serve.py model.pic [--levels 1,2,4,8] [--requests 4] [--prompt 16] [--tokens 32]
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


def run_level(engine, parallel: int, requests: int, prompt: list[int], tokens: int) -> dict:
    sock = bind("127.0.0.1", 0)
    server = make_server(create_app(engine, tokenizer=None, parallel=parallel, queue=parallel * requests),
                         log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        with httpx.Client() as http:
            streamed_request(http, url, prompt, 2)  # warm: the first request pays for the first prefill

        def client(_):  # a client keeps its connection, as real ones do
            with httpx.Client() as http:
                return [streamed_request(http, url, prompt, tokens) for _ in range(requests)]

        began = time.perf_counter()
        with ThreadPoolExecutor(parallel) as pool:
            results = [r for rs in pool.map(client, range(parallel)) for r in rs]
        wall = time.perf_counter() - began
    finally:
        server.should_exit = True
        thread.join()
        sock.close()
    per_request = [(r["tokens"] - 1) / r["decode_s"] for r in results if r["tokens"] > 1 and r["decode_s"] > 0]
    ttft = sorted(r["ttft_s"] for r in results)
    return {"parallel": parallel, "requests": len(results), "total_tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "per_request_tokens_per_s": statistics.median(per_request) if per_request else 0.0,
            "ttft_median_ms": statistics.median(ttft) * 1000, "ttft_p90_ms": ttft[math.ceil(0.9 * len(ttft)) - 1] * 1000}  # nearest rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--levels", default="1,2,4,8", help="concurrent requests per level, comma-separated")
    parser.add_argument("--requests", type=int, default=4, help="requests each client sends, one after another")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",")]
    engine = Engine(args.artifact, slots=max(levels))
    if args.prompt + args.tokens > engine.max_context:
        parser.error(f"--prompt + --tokens exceed the artifact's max context {engine.max_context}")
    prompt = [(7 * i + 1) % engine.vocab_size for i in range(args.prompt)]
    print(f"{args.artifact}: prompt {args.prompt} tokens, {args.tokens} generated per request, "
          f"{args.requests} requests per client")
    print(f"{'parallel':>8} {'requests':>8} {'total tok/s':>12} {'per-request tok/s':>18} {'TTFT median ms':>15} "
          f"{'TTFT p90 ms':>12}")
    for parallel in levels:
        row = run_level(engine, parallel, args.requests, prompt, args.tokens)
        print(f"{row['parallel']:>8} {row['requests']:>8} {row['total_tokens_per_s']:>12.1f} "
              f"{row['per_request_tokens_per_s']:>18.1f} {row['ttft_median_ms']:>15.1f} {row['ttft_p90_ms']:>12.1f}")


if __name__ == "__main__":
    main()
