"""`picompile serve --ray`: the server's replicas on a local Ray Serve instance (127.0.0.1) over the tiny artifact,
driven by the openai client: answers equal one engine's, the same 400s, streaming, and a replica killed mid-request.

One Ray instance and one deployment for the module (2 replicas of 2 slots, half a CPU each), shut down at its end.
The replicas' engines step slowly (tests/ray_replicas.py), so that a request is still running when its replica
is killed."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from byte_tokenizer import ByteTokenizer
from test_runtime_thin import ROOT
from test_serve import START_WAIT_S, TOKENIZER, WAIT_S, client, health, metrics, reference  # noqa: F401 (a fixture)
from test_serve import stream_and_whole, stream_completion, wait_until as serve_wait_until

REPLICAS = 2
REPLICA_HEADER = "x-picompile-replica"  # the replica that gave an answer (runtime/ray_serve.py)


def wait_until(condition, what: str, timeout_s: float = WAIT_S):
    """test_serve's, polling every 0.1 s: each poll here is a request through Ray."""
    serve_wait_until(condition, what, poll_s=0.1, timeout_s=timeout_s)


def test_serve_ray_without_ray_is_one_error_line_naming_the_extra(tmp_path):
    """Where ray is not installed (blocked here), `serve --ray` says which extra to install, and plain serve's
    module and `import runtime` still import."""
    code = ("import sys\nsys.modules['ray'] = None  # as on a machine without it\n"
            "import runtime, runtime.serve\nfrom picompile.cli import main\n"
            f"sys.exit(main(['serve', {str(tmp_path / 'model.pic')!r}, '--ray']))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == ["error: picompile serve --ray needs the ray extra (ray is not installed): "
                                          "pip install 'picompile[ray]'"]


def test_importing_the_runtime_does_not_import_ray():
    code = "import sys, runtime, runtime.serve\nprint(sorted(m for m in ('ray', 'runtime.ray_serve') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)
    assert result.stdout.strip() == "[]", result.stderr


@pytest.mark.parametrize("options, message", [
    (["--replicas", "2"], "error: --replicas needs --ray"),
    (["--ray", "--replicas", "2", "--max-replicas", "3"], "error: --replicas fixes the count; --min-replicas/--max-replicas "
                                                          "autoscale: give one or the other"),
    (["--ray", "--min-replicas", "2"], "error: --min-replicas needs --max-replicas (autoscaling's upper bound)"),
    (["--ray", "--min-replicas", "3", "--max-replicas", "2"], "error: --max-replicas 2 is below --min-replicas 3"),
    (["--ray", "--port", "0"], "error: --ray needs a fixed --port: Ray Serve's HTTP proxy binds it"),
])
def test_replica_options_are_checked_before_ray_starts(tmp_path, capsys, options, message):
    from picompile.cli import main

    assert main(["serve", str(tmp_path / "model.pic"), *options]) == 2
    assert capsys.readouterr().err.splitlines() == [message]


def test_the_example_serve_config_and_rayservice_are_valid_and_build_the_deployment():
    """examples/deploy: the config file (and the RayService's copy of it) pass Serve's schema, and their args make
    the autoscaled deployment, aiming at `parallel` ongoing requests per replica."""
    pytest.importorskip("ray.serve")
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from runtime import ray_serve

    config = yaml.safe_load((ROOT / "examples" / "deploy" / "serve_config.yaml").read_text())
    service = yaml.safe_load((ROOT / "examples" / "deploy" / "rayservice.yaml").read_text())
    for found in (config, yaml.safe_load(service["spec"]["serveConfigV2"])):
        (app,) = ServeDeploySchema.model_validate(found).applications
        assert app.import_path == "runtime.ray_serve:build"
        options = ray_serve.Deployment(**app.args).options()
        assert options["autoscaling_config"]["target_ongoing_requests"] == app.args["parallel"]
        ray_serve.build(app.args)  # Serve's own checks of the options, no cluster needed
    with pytest.raises(ValueError, match="unknown picompile deployment argument"):
        ray_serve.build({"artifact": "x.pic", "slots": 4})


@pytest.fixture(scope="module")
def ray_url(tiny_sparse_artifact):
    """The deployment's URL: 2 replicas of 2 slots each, the byte tokenizer, on a Ray instance of this process."""
    pytest.importorskip("ray.serve")
    import ray
    from ray import cloudpickle, serve

    import byte_tokenizer
    import ray_replicas
    from runtime import ray_serve
    from runtime.serve import bind

    for module in (byte_tokenizer, ray_replicas):  # tests/ is not on the replicas' path
        cloudpickle.register_pickle_by_value(module)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    ray_serve.start_local("127.0.0.1", port, cpus=2)
    try:
        deployment = ray_serve.Deployment(str(tiny_sparse_artifact), parallel=2, queue=8, threads=1,
                                          replicas=REPLICAS, replica_cpus=0.5, code_path=str(ROOT))
        ray_serve.deploy(deployment, ByteTokenizer(), ray_replicas.SlowReplica)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_completions_and_chat_equal_one_engine(ray_url, reference):
    api = client(ray_url)
    prompt = [3, 14, 15, 92, 65]
    answer = api.completions.create(model="any", prompt=prompt, max_tokens=8, temperature=0)
    expected = reference(prompt, 8)
    assert answer.choices[0].model_extra["token_ids"] == expected
    assert answer.choices[0].text == TOKENIZER.decode(expected)
    assert (answer.model, answer.usage.completion_tokens) == ("opt-tiny.pic", 8)
    messages = [{"role": "user", "content": "hi"}]
    chat = api.chat.completions.create(model="any", messages=messages, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == TOKENIZER.decode(reference(TOKENIZER.encode(TOKENIZER.chat_prompt(messages)), 6))
    assert [model.id for model in api.models.list().data] == ["opt-tiny.pic"]


def test_streaming_gives_the_same_tokens_as_a_whole_answer(ray_url):
    api = client(ray_url)
    sampling = dict(model="any", max_tokens=8, temperature=1.0, top_p=0.9, seed=5)
    chunks, streamed = stream_and_whole(api, sampling)
    assert (streamed[-1].choices[0].finish_reason, chunks[-1].usage.completion_tokens) == ("length", 8)
    messages = [{"role": "user", "content": "stream"}]
    chat_whole = api.chat.completions.create(messages=messages, **sampling).choices[0].message.content
    chat_chunks = list(api.chat.completions.create(messages=messages, stream=True, **sampling))
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == chat_whole


def test_concurrent_requests_over_the_replicas_equal_one_engine(ray_url, reference):
    """Requests enough to fill both replicas' slots: each greedy answer equals a single-slot engine's."""
    api = client(ray_url)
    prompts = [[1, 2, 3], [50, 60, 70, 80], [100, 5], [9] * 7, [33, 44], [120, 1, 2]]

    def ask(prompt):
        return api.completions.create(model="any", prompt=prompt, max_tokens=10, temperature=0).choices[0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, prompts))
    assert [a.model_extra["token_ids"] for a in answers] == [reference(p, 10) for p in prompts]


def test_bad_field_is_a_400_naming_it(ray_url):
    with pytest.raises(openai.BadRequestError) as raised:
        client(ray_url).completions.create(model="any", prompt=[1], max_tokens=1, top_p=2.0)
    assert raised.value.status_code == 400 and raised.value.param == "top_p"
    answer = httpx.post(f"{ray_url}/v1/chat/completions", content=b"{not json", timeout=WAIT_S)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_json"


def test_health_and_metrics_name_the_replica_and_count_the_replicas(ray_url):
    found = health(ray_url)
    assert found["deployment"] == {"status": "HEALTHY", "replicas": {"RUNNING": REPLICAS}}
    assert found["slots_idle"] + found["slots_processing"] == 2 and found["replica"]
    values = metrics(ray_url)
    assert values['picompile_replicas{state="RUNNING"}'] == REPLICAS and values["picompile_slots_total"] == 2


def test_a_killed_replica_fails_its_requests_and_is_replaced(ray_url, reference):
    """3 streamed requests running; the replica of the first is killed: its requests end with the project's error
    body (503 engine_unavailable; a stream's last event, then [DONE]), never a hang, the other replica's finish with
    the right tokens, Serve starts a replacement and later requests succeed."""
    import ray

    before = set()
    wait_until(lambda: before.add(health(ray_url)["replica"]) or len(before) == REPLICAS, "both replicas to answer")
    prompt, max_tokens = [1, 2, 3], 40  # ~2 s of the slow engine's steps: still running when the replica dies
    streams, wholes = [{} for _ in range(3)], [{} for _ in range(2)]

    def ask_whole(into):  # a whole answer: the right one, or the 503 error body if its replica was the one killed
        try:
            into["ids"] = client(ray_url).completions.create(model="any", prompt=prompt, max_tokens=max_tokens,
                                                             temperature=0).choices[0].model_extra["token_ids"]
        except openai.APIStatusError as error:
            into["status"], into["code"] = error.status_code, error.code

    threads = [*(threading.Thread(target=stream_completion, args=(ray_url, prompt, max_tokens, into), daemon=True)
                 for into in streams),
               *(threading.Thread(target=ask_whole, args=(into,), daemon=True) for into in wholes)]
    for thread in threads:
        thread.start()
    wait_until(lambda: all("headers" in s for s in streams), "the streams to start")  # each names its replica
    victim = streams[0]["headers"][REPLICA_HEADER]
    assert victim in before
    names = [actor for actor in ray.util.list_named_actors(all_namespaces=True)
             if actor["name"].startswith("SERVE_REPLICA::") and actor["name"].endswith(f"#{victim}")]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive(), "a request hung"
    for into in streams:
        if into["headers"].get(REPLICA_HEADER) == victim:  # the error body as its last event, then [DONE]
            assert into["error_code"] == "engine_unavailable" and into["done"], into
        else:
            assert into["done"] and into["error"] is None and into["ids"] == reference(prompt, max_tokens), into
    for into in wholes:
        assert into in ({"ids": reference(prompt, max_tokens)}, {"status": 503, "code": "engine_unavailable"})

    seen = set()

    def replaced():  # a replica not among the first two answers, and Serve counts two running again
        answer = health(ray_url)
        seen.add(answer["replica"])
        return answer["deployment"]["replicas"] == {"RUNNING": REPLICAS} and seen - before

    wait_until(replaced, "a replacement replica", timeout_s=START_WAIT_S)
    api = client(ray_url)
    for _ in range(4):
        answer = api.completions.create(model="any", prompt=[5, 6], max_tokens=4, temperature=0)
        assert answer.choices[0].model_extra["token_ids"] == reference([5, 6], 4)
