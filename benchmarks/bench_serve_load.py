"""`picompile serve` beside llama-server on the same GGUF file: speed at 1, 4 and 16 concurrent clients, the prefix
cache, and a load-and-fault run that counts what was answered, refused and lost (issue 52).

    python benchmarks/bench_serve_load.py ARTIFACT [--gguf FILE.gguf] [--parallel 4] [--queue 16] [--threads 2]
        [--llama-threads 1,2] [--levels 1,4,16] [--requests 3] [--tokens 32] [--load-seconds 120]
        [--load-clients 32] [--json PATH]

The servers run as their own processes on 127.0.0.1 (`python -m picompile serve ARTIFACT`, and llama.cpp's
`llama-server -m FILE.gguf -np PARALLEL --cont-batching` where scripts/build_llama_cpp.sh built it, once with its
OpenMP threads passive and once spinning, at each of --llama-threads (default: --threads): a peer at its best),
with the same slots (--parallel) and API key, one at a time (an idle llama-server whose OpenMP threads spin keeps
every core busy): every measurement starts each server in turn, measures it and stops it, so the servers alternate.

1. Levels: C clients each send --requests streamed greedy completions of a text prompt (held-out prose, 16-200
   tokens, a different one per request) for --tokens tokens, back to back. Per server and level: all tokens over
   the level's wall time, and time to first token (p50 / p99 over the requests; a request's first streamed token).
2. The prefix cache: the time to first token of (a) a chat's second turn (a long first turn and its answer sent
   again) and (b) a request whose long system prompt another request sent just before, each with the cache
   (`cache_prompt` true, both servers' default) and without (`cache_prompt` false), medians of 3.
3. Load and faults (--load-seconds): --load-clients clients (more than the slots and the queue hold) send, in a
   loop, a mix: streamed and whole completions of mixed lengths, chats that share a system prompt, streams the
   client drops after its first token, malformed JSON, a bad field, a request without the key and a body over the
   server's bound. Counted: answered (a whole answer, a stream to its [DONE]), refused by status (a 4xx: the
   kind's own, or 429 / 503 where the server was full), server errors (a 5xx for what the client sent), lost
   (a valid request with no answer: a 5xx, a cut stream, a connection error, a timeout: must be 0); the server's
   resident memory in each quarter of the run (sampled each second), in all and split into anonymous pages (the
   heap: flat means no growth per request) and pages of mapped files (the artifact's weights, read in as first
   touched: an embedding table's rows as new tokens appear), its slots and queue once the clients stop
   (idle means every dropped stream's slot was freed), and p50 / p99 time to first token and whole-request time.
4. A burst (--burst): that many clients at once, each one short whole completion on a connection of its own:
   answered, refused (429 / 503: the server full) and lost (must be 0), and the wall time until the last answer.
5. A replica killed (--parts ray_fault, not by default: it needs the `ray` extra): part 3's load on `serve --ray`
   with two replicas (--parallel slots and one kernel thread each), one replica's process SIGKILLed at half time.
   Its requests are counted refused where they end with the error body (503 engine_unavailable, or a stream's
   last event): lost must still be 0; Serve's replacement takes the load after.
6. Long prompts arriving (--parts arrivals, not by default): one client streams --arrival-stream tokens of an
   answer while others send --arrivals prompts of --arrival-prompt token ids each (one answer token, one after
   another, 0.3 s apart), from its first token on. Per server: the stream's gaps between tokens (p50, p99, the
   longest: how long a new prompt stalls a running answer), its tokens/s, and the prompts' time to first token
   (median). picompile runs at each of --prefill-chunks (`serve --prefill-chunk`; `-` is the default), beside
   llama-server.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import host as host_state  # noqa: E402
import llama_cpp  # noqa: E402

KEY = "bench-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
TIMEOUT_S = 300  # a request that takes longer is lost (never a measured figure)
START_S = 300
HELD_OUT = Path.home() / ".cache" / "picompile" / "bench_gguf" / "heldout.txt"


# ------------------------------------------------------------------------------------------------ servers

@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """How a server is started (`Server`)."""

    name: str
    command: list[str]
    port: int
    env: dict | None = None


class Server:
    """A server process on 127.0.0.1:port, stopped by SIGINT (then killed) when done."""

    def __init__(self, spec: ServerSpec):
        name, command, port, env = spec.name, spec.command, spec.port, spec.env
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True, env={**os.environ, **(env or {})})
        threading.Thread(target=self._drain, daemon=True).start()  # (a full stderr pipe would stall it)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{name} exited ({self.process.returncode}) before answering")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{name} did not answer within {START_S} s")

    def _drain(self) -> None:
        for _ in self.process.stderr:
            pass

    def memory(self) -> dict[str, int]:
        """Resident bytes: "rss" in all, "anon" (the heap: what a leak grows) and "file" (pages of mapped files: the
        artifact's weights, an embedding table's rows as new tokens first read them)."""
        fields = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file"}
        out = dict.fromkeys(fields.values(), 0)
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                name = line.split(maxsplit=1)[0] if line else ""
                if name in fields:
                    out[fields[name]] = int(line.split()[1]) * 1024
        except OSError:
            pass
        return out

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def picompile_server(args, port: int, prefill_chunk: int | None = None) -> ServerSpec:
    chunk = [] if prefill_chunk is None else ["--prefill-chunk", str(prefill_chunk)]
    return ServerSpec("picompile" + (f" --prefill-chunk {prefill_chunk}" if chunk else ""),
                      [sys.executable, "-m", "picompile", "serve", str(args.artifact), "--port", str(port),
                       "--parallel", str(args.parallel), "--queue", str(args.queue), "--threads", str(args.threads),
                       "--api-key", KEY, "--max-body-bytes", str(1 << 20), *chunk], port)


def picompile_ray_server(args, port: int) -> ServerSpec:
    """`serve --ray` with two replicas of --parallel slots and one kernel thread each (one a core here)."""
    return ServerSpec("picompile --ray", [sys.executable, "-m", "picompile", "serve", str(args.artifact), "--ray",
                                          "--replicas", "2", "--port", str(port), "--parallel", str(args.parallel),
                                          "--queue", str(args.queue), "--threads", "1", "--api-key", KEY,
                                          "--max-body-bytes", str(1 << 20)], port)


def kill_a_replica() -> dict:
    """SIGKILL one engine replica's Ray worker process (its title, ray::ServeReplica:APP:DEPLOYMENT, names the
    deployment; the front's is picompile-front): a replica that dies."""
    found = subprocess.run(["pgrep", "-af", "ServeReplica:picompile:picompile"], capture_output=True, text=True)
    pids = [int(line.split()[0]) for line in found.stdout.splitlines() if "picompile-front" not in line]
    if not pids:
        return {"killed": None}
    os.kill(pids[0], signal.SIGKILL)
    return {"killed": pids[0], "replicas_seen": len(pids), "at": time.monotonic()}


def llama_servers(args, port: int) -> list[ServerSpec]:
    """llama-server at each of --llama-threads (default: --threads) and --llama-wait-policy (its OpenMP threads
    passive and spinning): a peer at its best."""
    if args.gguf is None:
        return []
    try:
        llama = llama_cpp.find()
        binary = llama.tool("llama-server")
    except llama_cpp.LlamaCppMissing as error:
        print(f"llama-server: not measured ({error})")
        return []
    context = args.context * args.parallel  # llama-server splits its context over the slots
    threads = [int(t) for t in (args.llama_threads or str(args.threads)).split(",")]
    settings = [(t, policy) for t in threads for policy in args.llama_wait_policy.split(",")]
    servers = []
    for offset, (count, policy) in enumerate(settings):
        env = dataclasses.replace(llama, wait_policy=policy).env()
        label = f"llama-server OMP {policy}" + (f" -t {count}" if len(threads) > 1 else "")
        servers.append(ServerSpec(label, [
            str(binary), "-m", str(args.gguf), "--port", str(port + offset), "--host", "127.0.0.1", "-np",
            str(args.parallel), "--cont-batching", "-c", str(context), "-t", str(count), "--api-key", KEY],
            port + offset, env=env))
    return servers


# ------------------------------------------------------------------------------------------------ requests

def paragraphs(count: int, seed: int) -> list[str]:
    """Prompts of held-out prose, of 16-200 tokens or so (a paragraph's first words)."""
    filler = "the quick brown fox jumps over a lazy dog " * 500  # (no held-out text on this machine)
    text = (HELD_OUT.read_text() if HELD_OUT.exists() else filler).split()
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        words = rng.choice([12, 30, 60, 150])
        start = rng.randrange(0, max(1, len(text) - words))
        out.append(" ".join(text[start:start + words]))
    return out


def stream(http: httpx.Client, url: str, path: str, body: dict, drop_after_first: bool = False) -> dict:
    """A streamed request: {"ttft": s, "total": s, "tokens": n, "done": saw [DONE], "times": each token's
    perf_counter}; raises on a non-200."""
    began = time.perf_counter()
    first, tokens, done, times = None, 0, False, []
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", f"{url}{path}", json=body, headers=HEADERS, timeout=TIMEOUT_S) as response:
        if response.status_code != 200:
            response.read()
            return {"status": response.status_code}
        usage = None
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:  # the server's error body as the stream's last event
                return {"status": 200, "error": chunk["error"].get("code") or chunk["error"].get("type")}
            if chunk.get("usage"):
                usage = chunk["usage"]
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
                tokens += 1
                times.append(time.perf_counter())
                if first is None:
                    first = times[-1] - began
                    if drop_after_first:
                        return {"status": 200, "dropped": True}
    if usage:
        tokens = usage.get("completion_tokens", tokens)
    return {"status": 200, "ttft": first, "total": time.perf_counter() - began, "tokens": tokens, "done": done,
            "times": times}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


# ------------------------------------------------------------------------------------------------ 1. levels

def level(server: Server, clients: int, requests: int, tokens: int, seed: int) -> dict:
    prompts = paragraphs(clients * requests, seed)
    results, lock = [], threading.Lock()

    def client(c: int) -> None:
        with httpx.Client() as http:
            for r in range(requests):
                got = stream(http, server.url, "/v1/completions", {"prompt": prompts[c * requests + r],
                                                                   "max_tokens": tokens, "temperature": 0})
                with lock:
                    results.append(got)

    began = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.perf_counter() - began
    ok = [r for r in results if r.get("status") == 200 and r.get("done")]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    return {"clients": clients, "requests": len(results), "answered": len(ok),
            "tokens_per_s": sum(r["tokens"] for r in ok) / wall, "ttft_p50": percentile(ttft, 0.5),
            "ttft_p99": percentile(ttft, 0.99)}


# ------------------------------------------------------------------------------------------------ 2. the prefix cache

def first_token_s(server: Server, body: dict, path: str = "/v1/chat/completions") -> float:
    with httpx.Client() as http:
        got = stream(http, server.url, path, {**body, "max_tokens": 4, "temperature": 0})
    if got.get("status") != 200 or got.get("ttft") is None:
        raise RuntimeError(f"{server.name}: a prefix-cache request failed: {got}")
    return got["ttft"]


def prefix_cache(server: Server, seed: int) -> dict:
    """Medians of 3 of the time to first token with and without the prefix cache."""
    long_text = " ".join(paragraphs(6, seed + 1))  # ~400-600 tokens
    out = {}
    for cache in (True, False):
        second, shared = [], []
        for round_ in range(3):
            first_turn = [{"role": "user", "content": f"Summarise this ({round_}, {cache}): {long_text}"}]
            with httpx.Client() as http:
                answer = http.post(f"{server.url}/v1/chat/completions", headers=HEADERS, timeout=TIMEOUT_S,
                                   json={"messages": first_turn, "max_tokens": 16, "temperature": 0,
                                         "cache_prompt": cache}).json()
            reply = answer["choices"][0]["message"]["content"]
            turn = first_turn + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
            second.append(first_token_s(server, {"messages": turn, "cache_prompt": cache}))
            system = {"role": "system", "content": f"You answer questions about this text ({round_}, {cache}): "
                                                   f"{long_text}"}
            first_token_s(server, {"messages": [system, {"role": "user", "content": "Who?"}], "cache_prompt": cache})
            shared.append(first_token_s(server, {"messages": [system, {"role": "user", "content": "Where?"}],
                                                 "cache_prompt": cache}))
        out["cached" if cache else "uncached"] = {"second_turn_ttft": statistics.median(second),
                                                  "shared_system_ttft": statistics.median(shared)}
    return out


# ------------------------------------------------------------------------------------------------ 3. load and faults

KINDS = (("stream", 30), ("whole", 20), ("chat_shared", 15), ("drop", 10), ("bad_json", 5), ("bad_field", 5),
         ("no_key", 5), ("huge_body", 5), ("long_prompt", 5))
EXPECTED = {"bad_json": 400, "bad_field": 400, "no_key": 401, "huge_body": 413}
FULL = (429, 503)  # the server was full (its queue, its bound on requests): a refusal, not a loss
UNAVAILABLE = ("engine_unavailable",)  # a 503's code (or a stream's last event) where the replica serving it died
RETRY_WAIT_S = 0.5  # a client's wait after such a refusal (both servers ask 1 s; clients retry sooner)


def load_run(server: Server, seconds: float, clients: int, tokens: int, seed: int, fault=None) -> dict:
    """The load run (part 3); `fault`: a callable run at half time (a replica killed), its result in "fault"."""
    counts = {"answered": 0, "refused": {}, "server_errors": {}, "lost": {}}
    faults = []
    ttft, total, lock = [], [], threading.Lock()
    system = "You are a careful assistant. " + " ".join(paragraphs(2, seed + 7))
    stop_at = time.monotonic() + seconds
    rss = []

    def count(bucket: str, key: str) -> None:
        with lock:
            counts[bucket][key] = counts[bucket].get(key, 0) + 1
        if key in map(str, FULL):  # as a client that reads Retry-After waits (not a loop that takes the CPU)
            time.sleep(RETRY_WAIT_S)

    def one(http: httpx.Client, kind: str, rng: random.Random) -> None:
        url = server.url
        try:
            if kind in EXPECTED:
                if kind == "bad_json":
                    response = http.post(f"{url}/v1/completions", content=b'{"prompt": [1, 2', headers=HEADERS)
                elif kind == "bad_field":
                    response = http.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": -3},
                                         headers=HEADERS)
                elif kind == "no_key":
                    response = http.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                else:
                    response = http.post(f"{url}/v1/completions", json={"prompt": "x" * (2 << 20)}, headers=HEADERS)
                status = response.status_code
                if status < 500:
                    count("refused", str(status) if status == EXPECTED[kind] or status in FULL else
                          f"{status} (for {kind})")
                else:
                    count("server_errors", f"{kind} {status}")
                return
            prompt = paragraphs(1, rng.randrange(1 << 30))[0]
            if kind == "long_prompt":
                prompt = " ".join(paragraphs(3, rng.randrange(1 << 30)))
            if kind == "chat_shared":
                body, path = {"messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": prompt[:80]}]}, "/v1/chat/completions"
            else:
                body, path = {"prompt": prompt}, "/v1/completions"
            body.update(max_tokens=rng.choice([4, tokens]), temperature=0)
            if kind == "whole":
                began = time.perf_counter()
                response = http.post(f"{url}{path}", json=body, headers=HEADERS, timeout=TIMEOUT_S)
                if response.status_code == 200 and response.json().get("choices"):
                    with lock:
                        counts["answered"] += 1
                        total.append(time.perf_counter() - began)
                elif response.status_code in FULL or response.status_code == 400:  # (a prompt over the context)
                    code = response.json().get("error", {}).get("code") if response.status_code == 503 else None
                    count("refused", f"503 {code}" if code in UNAVAILABLE else str(response.status_code))
                else:
                    count("lost", f"whole {response.status_code}")
                return
            got = stream(http, url, path, body, drop_after_first=kind == "drop")
            if got.get("dropped"):
                count("refused", "dropped by the client")
            elif got.get("error") in UNAVAILABLE:  # (its replica died under it: the error body, not a loss)
                count("refused", f"stream ended: {got['error']}")
            elif got.get("status") == 200 and got.get("done"):
                with lock:
                    counts["answered"] += 1
                    total.append(got["total"])
                    if got.get("ttft") is not None:
                        ttft.append(got["ttft"])
            elif got.get("status") in FULL or got.get("status") == 400:
                count("refused", str(got["status"]))
            else:
                count("lost", f"{kind} {got.get('status')} done={got.get('done')}")
        except (httpx.HTTPError, json.JSONDecodeError) as error:
            count("lost", f"{kind} {type(error).__name__}")

    def client(c: int) -> None:
        rng = random.Random(seed * 1000 + c)
        kinds = [k for k, w in KINDS for _ in range(w)]
        with httpx.Client(timeout=TIMEOUT_S) as http:
            while time.monotonic() < stop_at:
                one(http, rng.choice(kinds), rng)

    def sample_memory() -> None:
        while time.monotonic() < stop_at:
            rss.append(server.memory())
            time.sleep(1.0)

    def at_half_time() -> None:
        time.sleep(seconds / 2)
        faults.append(fault())

    sampler = threading.Thread(target=sample_memory, daemon=True)
    sampler.start()
    if fault is not None:
        threading.Thread(target=at_half_time, daemon=True).start()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    sampler.join()
    time.sleep(2.0)  # a dropped stream's slot is freed at the scheduler's next step
    idle = (httpx.get(f"{server.url}/health", headers=HEADERS, timeout=10).json()
            if server.name.startswith("picompile") else {})  # (its slots)
    quarter = max(1, len(rss) // 4)
    by_quarter = {f"{kind}_mib_by_quarter": [statistics.mean(m[kind] for m in rss[i * quarter:(i + 1) * quarter])
                                             / 2**20 for i in range(4)] if len(rss) >= 4 else None
                  for kind in ("rss", "anon", "file")}
    return {"seconds": seconds, "clients": clients, **counts, **({"fault": faults} if fault else {}), **by_quarter,
            "rss_max_mib": max(m["rss"] for m in rss) / 2**20 if rss else None, "after": idle,
            "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "total_p50": percentile(total, 0.5), "total_p99": percentile(total, 0.99)}


# ------------------------------------------------------------------------------------------------ 4. a burst

def burst(server: Server, clients: int) -> dict:
    statuses, began = {}, time.perf_counter()

    def one(c: int) -> str:
        try:
            response = httpx.post(f"{server.url}/v1/completions", headers=HEADERS, timeout=TIMEOUT_S,
                                  json={"prompt": f"Request {c}: the weather today is", "max_tokens": 4,
                                        "temperature": 0})
            if response.status_code == 200 and not response.json().get("choices"):
                return "200 empty"
            return str(response.status_code)
        except httpx.HTTPError as error:
            return type(error).__name__

    with ThreadPoolExecutor(clients) as pool:
        for status in pool.map(one, range(clients)):
            statuses[status] = statuses.get(status, 0) + 1
    answered = statuses.get("200", 0)
    refused = sum(n for k, n in statuses.items() if k in map(str, FULL))
    return {"clients": clients, "answered": answered, "refused": refused,
            "lost": clients - answered - refused, "statuses": statuses, "seconds": time.perf_counter() - began}


# ------------------------------------------------------------------------------------------------ 6. arrivals

STREAMED_PROMPT = ("Write a Python module that implements a binary search tree with insert, delete, search, "
                   "in-order, pre-order and post-order traversal, each method with a docstring and type hints.")


def arrivals(server: Server, stream_tokens: int, count: int, prompt_tokens: int, seed: int) -> dict:
    """Part 6: a running answer's gaps between tokens while long prompts arrive."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 20000) for _ in range(prompt_tokens)] for _ in range(count)]
    started, firsts = threading.Event(), []

    def arrive() -> None:
        started.wait(TIMEOUT_S)
        with httpx.Client() as http:
            for prompt in prompts:
                got = stream(http, server.url, "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                                                   "temperature": 0, "cache_prompt": False})
                if got.get("ttft") is None:
                    raise RuntimeError(f"{server.name}: an arriving prompt failed: {got}")
                firsts.append(got["ttft"])
                time.sleep(0.3)

    arriving = threading.Thread(target=arrive)
    arriving.start()
    with httpx.Client() as http:
        body = {"messages": [{"role": "user", "content": STREAMED_PROMPT}], "max_tokens": stream_tokens,
                "temperature": 0}
        http.post(f"{server.url}/v1/chat/completions", json={**body, "max_tokens": 1}, headers=HEADERS,
                  timeout=TIMEOUT_S)  # (warm: the streamed answer's own prefill is not what is measured)
        threading.Timer(0.5, started.set).start()  # the prompts arrive once the answer streams
        got = stream(http, server.url, "/v1/chat/completions", body)
    started.set()
    arriving.join()
    times = got["times"]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"stream_tokens": got["tokens"], "stream_tokens_per_s": len(gaps) / (times[-1] - times[0]),
            "gap_p50": percentile(gaps, 0.5), "gap_p99": percentile(gaps, 0.99), "gap_max": max(gaps),
            "arrival_ttft_p50": statistics.median(firsts), "arrivals": len(firsts)}


# ------------------------------------------------------------------------------------------------ the run

def ms(value) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF file the artifact was built from")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--queue", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=1024, help="llama-server's context per slot")
    parser.add_argument("--levels", default="1,4,16")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--load-seconds", type=float, default=120.0)
    parser.add_argument("--load-clients", type=int, default=32)
    parser.add_argument("--burst", type=int, default=500, help="clients at once in the burst (0: none)")
    parser.add_argument("--llama-wait-policy", default="passive,active", help="llama-server's OMP_WAIT_POLICY rows")
    parser.add_argument("--llama-threads", default=None, help="llama-server's thread counts, comma-separated, each "
                        "with every wait policy (default: --threads)")
    parser.add_argument("--parts", default="levels,prefix,load,burst", help="which of the run's parts to run")
    parser.add_argument("--arrival-stream", type=int, default=96, help="part 6: tokens of the streamed answer")
    parser.add_argument("--arrivals", type=int, default=3, help="part 6: long prompts sent while it streams")
    parser.add_argument("--arrival-prompt", type=int, default=448, help="part 6: token ids of each such prompt")
    parser.add_argument("--prefill-chunks", default="512,128,64", help="part 6: picompile's --prefill-chunk values")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    state = host_state.HostState.before()
    specs = [picompile_server(args, 18431), *llama_servers(args, 18432)]
    results = {"levels": {s.name: [] for s in specs}, "prefix": {}, "load": {}, "burst": {}}
    parts = set(args.parts.split(","))
    for clients in map(int, args.levels.split(",") if "levels" in parts else []):
        for spec in specs:
            with Server(spec) as server:
                row = level(server, clients, args.requests, args.tokens, seed=clients)
            results["levels"][spec.name].append(row)
            print(f"{spec.name} {clients} clients: {row['tokens_per_s']:.1f} tok/s, TTFT p50 "
                  f"{ms(row['ttft_p50'])} ms p99 {ms(row['ttft_p99'])} ms ({row['answered']}/{row['requests']})",
                  flush=True)
    results["ray_fault"], results["arrivals"] = {}, {}
    chunked = [picompile_server(args, 18451 + i, None if chunk == "-" else int(chunk))
               for i, chunk in enumerate(args.prefill_chunks.split(","))]
    for part, run in (("prefix", lambda server: prefix_cache(server, seed=3)),
                      ("load", lambda server: load_run(server, args.load_seconds, args.load_clients, args.tokens, 5)),
                      ("burst", lambda server: burst(server, args.burst)),
                      ("ray_fault", lambda server: load_run(server, args.load_seconds, args.load_clients, args.tokens,
                                                            6, fault=kill_a_replica)),
                      ("arrivals", lambda server: arrivals(server, args.arrival_stream, args.arrivals,
                                                           args.arrival_prompt, 7))):
        if part not in parts or (part in ("load", "ray_fault") and args.load_seconds <= 0) or (
                part == "burst" and args.burst <= 0):
            continue
        servers = {"ray_fault": [picompile_ray_server(args, 18441)], "arrivals": chunked + specs[1:]}
        for spec in servers.get(part, specs):
            with Server(spec) as server:
                results[part][spec.name] = run(server)
            print(spec.name, part, json.dumps(results[part][spec.name]), flush=True)
    state.after()
    results["host"] = state.summary()
    print(results["host"])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
