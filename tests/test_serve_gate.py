"""The server's gate (runtime/gate.py): API keys, the bounds on bodies and on requests at once, CORS; each refusal a
4xx with the error body, counted in /metrics. Live servers on 127.0.0.1 over the tiny artifact."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from runtime import Engine
from runtime.gate import Policy, read_keys
from test_serve import GatedEngine, WAIT_S, health, live_server, metrics, wait_until

KEYS = frozenset({"key-one", "key-two"})
BODY = {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def keyed_server(tiny_sparse_artifact):
    policy = Policy(api_keys=KEYS, max_body_bytes=4096)
    with live_server(Engine(tiny_sparse_artifact, slots=2), tokenizer=None, parallel=2, policy=policy) as url:
        yield url


def refused(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"]


def test_a_request_without_a_valid_key_is_a_401(keyed_server):
    url = f"{keyed_server}/v1/completions"
    refused(httpx.post(url, json=BODY), 401, "invalid_api_key")
    refused(httpx.post(url, json=BODY, headers={"Authorization": "Bearer key-three"}), 401, "invalid_api_key")
    refused(httpx.post(url, json=BODY, headers={"Authorization": "key-one"}), 401, "invalid_api_key")  # no scheme
    refused(httpx.get(f"{keyed_server}/metrics"), 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_server}/v1", api_key="wrong", max_retries=0).completions.create(
            model="any", **BODY)
    assert health(keyed_server)["status"] == "ok"  # a probe holds no key
    for key in sorted(KEYS):
        answer = openai.OpenAI(base_url=f"{keyed_server}/v1", api_key=key, max_retries=0).completions.create(
            model="any", **BODY)
        assert len(answer.choices[0].model_extra["token_ids"]) == 3
    found = httpx.get(f"{keyed_server}/metrics", headers={"Authorization": "Bearer key-one"}).text
    assert 'picompile_requests_rejected_total{reason="unauthorized"} 5' in found


def test_a_body_over_the_bound_is_a_413_before_the_endpoint_reads_it(keyed_server):
    url, key = f"{keyed_server}/v1/completions", {"Authorization": "Bearer key-one"}
    big = {**BODY, "user": "x" * 5000}
    refused(httpx.post(url, json=big, headers=key), 413, "body_too_large")

    def chunks():  # no Content-Length: refused as its bytes arrive
        yield b'{"prompt": [1], "user": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    refused(httpx.post(url, content=chunks(), headers={**key, "Content-Type": "application/json"}), 413,
            "body_too_large")
    ok = httpx.post(url, json=BODY, headers=key)  # the server goes on
    assert ok.status_code == 200


def test_requests_past_the_bound_at_once_are_429s(tiny_sparse_artifact):
    engine = GatedEngine(Engine(tiny_sparse_artifact, slots=1))
    with live_server(engine, tokenizer=None, parallel=1, queue=4, policy=Policy(max_requests=2)) as url:
        engine.hold()
        try:
            with ThreadPoolExecutor(2) as pool:
                held = [pool.submit(httpx.post, f"{url}/v1/completions", json=BODY, timeout=WAIT_S) for _ in range(2)]
                wait_until(lambda: health(url)["slots_processing"] + health(url)["queue_depth"] == 2,
                           "two requests in flight")
                response = httpx.post(f"{url}/v1/completions", json=BODY)
                refused(response, 429, "too_many_requests")
                assert response.headers["retry-after"] == "1"
                engine.open()
                assert [f.result().status_code for f in held] == [200, 200]
        finally:
            engine.open()
        assert metrics(url)['picompile_requests_rejected_total{reason="too_many_requests"}'] == 1


def test_cors_is_off_unless_an_origin_is_asked(tiny_sparse_artifact, keyed_server):
    preflight = {"Origin": "http://page.example", "Access-Control-Request-Method": "POST"}
    answer = httpx.options(f"{keyed_server}/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in answer.headers
    policy = Policy(cors_origins=("http://page.example",))
    with live_server(Engine(tiny_sparse_artifact), tokenizer=None, policy=policy) as url:
        answer = httpx.options(f"{url}/v1/completions", headers=preflight)
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "http://page.example"
        other = httpx.options(f"{url}/v1/completions", headers={**preflight, "Origin": "http://elsewhere.example"})
        assert "access-control-allow-origin" not in other.headers


def test_keys_come_from_options_a_file_and_the_environment(tmp_path: Path):
    listed = tmp_path / "keys"
    listed.write_text("# team keys\nalpha\n\n  beta  \n")
    assert read_keys(["gamma"], listed, {"PICOMPILE_API_KEY": "delta"}) == {"alpha", "beta", "gamma", "delta"}
    assert read_keys([], None, {}) == frozenset()
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_keys([], tmp_path / "empty", {})
    with pytest.raises(ValueError, match="cannot read"):
        read_keys([], tmp_path / "missing", {})
    with pytest.raises(ValueError, match="one word"):
        read_keys(["two words"], None, {})


def test_serve_refuses_a_key_file_it_cannot_use_in_one_line(tiny_sparse_artifact, tmp_path: Path):
    import subprocess
    import sys

    from test_runtime_thin import ROOT

    for key_file, message in ((tmp_path / "missing", "cannot read the key file"), (tmp_path, "cannot read the key file")):
        run = subprocess.run([sys.executable, "-m", "picompile", "serve", str(tiny_sparse_artifact), "--port", "0",
                              "--api-key-file", str(key_file)], cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)
        assert run.returncode == 2
        assert run.stderr.startswith("error: ") and message in run.stderr and len(run.stderr.splitlines()) == 1
