"""Built-in server control endpoints over real loopback HTTP: abort (prefix match, partial outputs,
queued aborts), flush_cache, pause modes with continue, weight updates from disk (version, path,
rollback on a bad path) and the launcher's stop-by-PID.

Long generations use `ignore_eos` and a large `max_new_tokens` on a 4096-token context, and every
test waits for the server's own load report (never a sleep) before acting on a running request.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from megatron_bapo.server.config import parse_args
from megatron_bapo.server.launch import start_server
from server_helpers import http

LONG = {"max_new_tokens": 3500, "temperature": 0, "ignore_eos": True}
POOL = ThreadPoolExecutor(8)



def bg(url: str, body) -> Future:
    return POOL.submit(http, url, body)


def loads(url: str) -> dict:
    return http(url + "/v1/loads", method="GET")[1]["loads"][0]


def wait_for(pred, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def wait_running(url: str, num: int, num_waiting: int = 0) -> None:
    wait_for(lambda: (lambda l: l["num_running_reqs"] >= num and l["num_waiting_reqs"] >= num_waiting)(loads(url)),
             f"{num} running / {num_waiting} waiting requests")


def wait_idle(url: str) -> None:
    wait_for(lambda: (lambda l: l["num_running_reqs"] + l["num_waiting_reqs"] == 0)(loads(url)), "idle")


@pytest.fixture(scope="module")
def server(tiny_hf_dir):
    args = ["--num-threads", "1", "--context-length", "4096", "--max-running-requests", "2"]
    with start_server(tiny_hf_dir, extra_args=args) as handle:
        yield handle


def greedy(url: str, prompt: list, num: int) -> list:
    status, out = http(url + "/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": num, "temperature": 0, "ignore_eos": True}})
    assert status == 200, out
    return out["output_ids"]


def test_abort_prefix_match_returns_partial_outputs(server):
    url = server.url
    f1 = bg(url + "/generate", {"input_ids": [5, 6], "rid": "job_1", "return_logprob": True, "sampling_params": LONG})
    f10 = bg(url + "/generate", {"input_ids": [7, 8], "rid": "job_10", "return_logprob": True, "sampling_params": LONG})
    wait_running(url, 2)
    status, dup = http(url + "/generate", {"input_ids": [1], "rid": "job_1", "sampling_params": {"max_new_tokens": 1}})
    assert status == 400 and "Duplicate" in dup["error"]["message"]
    assert http(url + "/abort_request", {"rid": "job"}) == (200, None)  # not an exact in-flight rid: ignored
    assert http(url + "/abort_request", {"rid": "job_1"}) == (200, None)  # prefix-aborts job_1 and job_10
    for fut in (f1, f10):
        status, out = fut.result(timeout=120)
        assert status == 200
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["finish_reason"]["message"] == "Aborted"
        assert 0 < len(out["output_ids"]) < LONG["max_new_tokens"]
        assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    wait_idle(url)


def test_queued_abort_and_flush_cache(server):
    url = server.url
    assert http(url + "/flush_cache", method="GET")[1].startswith("Cache flushed")
    futs = [bg(url + "/generate", {"input_ids": [10 + i], "return_logprob": True, "sampling_params": LONG})
            for i in range(3)]
    wait_running(url, 2, num_waiting=1)  # --max-running-requests 2: the third one queues
    status, text = http(url + "/flush_cache")
    assert (status, text) == (400, "Flush cache failed.")
    status, text = http(url + "/flush_cache?timeout=0.2")
    assert (status, text) == (400, "Timed out waiting for idle state.")
    assert http(url + "/abort_request", {"abort_all": True}) == (200, None)
    outs = [f.result(timeout=120)[1] for f in futs]
    reasons = sorted(o["meta_info"]["finish_reason"]["message"] for o in outs)
    assert reasons == ["Abort in waiting queue", "Aborted", "Aborted"]
    queued = next(o for o in outs if o["meta_info"]["finish_reason"]["message"] == "Abort in waiting queue")
    assert queued["output_ids"] == [] and queued["meta_info"]["completion_tokens"] == 0
    assert queued["meta_info"]["output_token_logprobs"] == []
    wait_idle(url)
    assert http(url + "/flush_cache")[0] == 200


def test_pause_abort_holds_new_requests_until_continue(server):
    url = server.url
    running = bg(url + "/generate", {"input_ids": [3, 4], "sampling_params": LONG})
    wait_running(url, 1)
    status, reply = http(url + "/pause_generation", {"mode": "abort"})
    assert (status, reply) == (200, {"message": "Generation paused successfully.", "status": "ok"})
    # pause(abort) returns only after in-flight calls returned (the client thread may lag a little)
    assert loads(url)["num_running_reqs"] == 0
    assert running.result(timeout=60)[1]["meta_info"]["finish_reason"]["type"] == "abort"
    held = bg(url + "/generate", {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 3}})
    assert http(url + "/health_generate", method="GET")[0] == 503
    assert http(url + "/health", method="GET")[0] == 503  # as SGLang 0.5.23's probe answers while paused (seen live)
    assert http(url + "/flush_cache")[0] == 200
    assert not held.done() and loads(url)["num_running_reqs"] == 0
    assert http(url + "/continue_generation", {})[1]["message"] == "Generation continued successfully."
    status, out = held.result(timeout=120)
    assert status == 200 and len(out["output_ids"]) == 3


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_retract_and_in_place_continue_token_identical(server, mode):
    url = server.url
    prompt, num = [20, 21, 22], 600
    expected = greedy(url, prompt, num)
    fut = bg(url + "/generate", {"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "max_new_tokens": num, "temperature": 0, "ignore_eos": True}})
    wait_running(url, 1)
    assert http(url + "/pause_generation", {"mode": mode})[0] == 200
    state = loads(url)
    if mode == "retract":
        assert (state["num_running_reqs"], state["num_waiting_reqs"]) == (1 - 1, 1)
        assert http(url + "/flush_cache")[0] == 200  # KV freed: flushable
    else:
        assert state["num_running_reqs"] == 1
        assert http(url + "/flush_cache")[0] == 400  # KV resident
    assert not fut.done()
    assert http(url + "/continue_generation", {})[0] == 200
    status, out = fut.result(timeout=120)
    assert status == 200 and out["output_ids"] == expected
    assert out["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": num}


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory):
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_other"), seed=1)


def greedy_lp(url: str, prompt: list, num: int) -> tuple[list, list]:
    status, out = http(url + "/generate", {"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "max_new_tokens": num, "temperature": 0, "ignore_eos": True}})
    assert status == 200, out
    return out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]


def test_update_weights_from_disk_changes_outputs_and_version(server, tiny_hf_dir, other_ckpt):
    from transformers import AutoModelForCausalLM

    url = server.url
    prompt = [30, 31, 32]
    before = greedy_lp(url, prompt, 16)
    status, reply = http(url + "/update_weights_from_disk", {"model_path": str(other_ckpt), "weight_version": "7"})
    assert status == 200 and reply["success"] is True and "Weight version updated to 7." in reply["message"]
    info = http(url + "/get_model_info", method="GET")[1]
    assert info["model_path"] == str(other_ckpt) and info["weight_version"] == "7"
    status, out = http(url + "/generate", {"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}})
    assert out["meta_info"]["weight_version"] == "7"
    after = (out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]])
    assert after != before
    ref = AutoModelForCausalLM.from_pretrained(other_ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(ref(input_ids=torch.tensor([prompt + after[0]])).logits[0], dim=-1)
    expected = [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(after[0])]
    torch.testing.assert_close(torch.tensor(after[1]), torch.tensor(expected), atol=1e-4, rtol=0)

    # A bad path is a 400 with rollback: same weights, same version, same path.
    status, reply = http(url + "/update_weights_from_disk", {"model_path": "/nonexistent/ckpt", "weight_version": "8"})
    assert status == 400 and reply["success"] is False and "nonexistent" in reply["message"]
    info = http(url + "/get_model_info", method="GET")[1]
    assert info["weight_version"] == "7" and info["model_path"] == str(other_ckpt)
    assert greedy_lp(url, prompt, 16) == after

    # Back to the original weights; outputs return to what they were.
    assert http(url + "/update_weights_from_disk", {"model_path": str(tiny_hf_dir)})[0] == 200
    assert greedy_lp(url, prompt, 16) == before


def test_weight_version_is_read_at_reply_time(server, tiny_hf_dir):
    """Update under an in-place pause with a resident request: its reply carries the new version."""
    url = server.url
    fut = bg(url + "/generate", {"input_ids": [1, 2, 3], "sampling_params": {**LONG, "max_new_tokens": 800}})
    wait_running(url, 1)
    assert http(url + "/pause_generation", {"mode": "in_place"})[0] == 200
    # In place, the resident request keeps its KV: no flush (SGLang 0.5.23 refuses one, as tested below).
    status, reply = http(url + "/update_weights_from_disk", {"model_path": str(tiny_hf_dir), "weight_version": "v2",
                                                             "flush_cache": False})
    assert status == 200, reply
    assert http(url + "/continue_generation", {})[0] == 200
    status, out = fut.result(timeout=120)
    assert status == 200 and out["meta_info"]["weight_version"] == "v2"
    status, reply = http(url + "/update_weight_version", {"new_version": "v3"})
    assert reply == {"success": True, "message": "Success", "new_version": "v3"}
    assert http(url + "/model_info", method="GET")[1]["weight_version"] == "v3"


def test_update_without_pause_waits_or_aborts_inflight(server, tiny_hf_dir):
    url = server.url
    fut = bg(url + "/generate", {"input_ids": [4, 5], "sampling_params": LONG})
    wait_running(url, 1)
    status, reply = http(url + "/update_weights_from_disk", {"model_path": str(tiny_hf_dir),
                                                             "abort_all_requests": True})
    assert status == 200 and reply["success"] is True
    status, out = fut.result(timeout=120)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < LONG["max_new_tokens"]


def test_bad_control_bodies_get_400(server):
    url = server.url
    assert http(url + "/pause_generation", {"mode": "sideways"})[0] == 400
    assert http(url + "/update_weights_from_disk", {})[0] == 400
    assert http(url + "/update_weight_version", {"new_version": 3})[0] == 400
    status, out = http(url + "/update_weights_from_tensor", {"serialized_named_tensors": []})
    assert status == 400 and out["success"] is False
    assert http(url + "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})[0] == 200


def test_cli_accepts_sglang_flags_and_rejects_unknown(capsys):
    cfg = parse_args(["--model-path", "/m", "--tp-size", "1", "--mem-fraction-static", "0.8",
                      "--trust-remote-code", "--context-length", "1024", "--random-seed", "5"])
    assert (cfg.model_path, cfg.host, cfg.port, cfg.context_length, cfg.random_seed) == ("/m", "127.0.0.1", 30000, 1024, 5)
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "/m", "--no-such-flag"])


def test_client_disconnect_aborts_its_request(server):
    """Paused in place, the request cannot finish by itself: only the disconnect abort can remove it."""
    url = server.url
    fut = POOL.submit(http, url + "/generate", {"input_ids": [6, 6], "sampling_params": LONG}, timeout=5.0)
    wait_running(url, 1)
    assert http(url + "/pause_generation", {"mode": "in_place"})[0] == 200
    with pytest.raises(OSError):  # urllib's timeout: the client gives up and closes the socket
        fut.result(timeout=60)
    wait_idle(url)
    assert http(url + "/continue_generation", {})[0] == 200
    assert http(url + "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})[0] == 200


def test_broken_checkpoint_update_rolls_back(server, tiny_hf_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_hf_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated weights, valid config
    before = greedy_lp(server.url, [8, 9], 6)
    version = http(server.url + "/model_info", method="GET")[1]["weight_version"]
    status, reply = http(server.url + "/update_weights_from_disk", {"model_path": str(broken), "weight_version": "x"})
    assert status == 400 and reply["success"] is False
    assert http(server.url + "/model_info", method="GET")[1]["weight_version"] == version
    assert greedy_lp(server.url, [8, 9], 6) == before


def test_update_without_pause_waits_for_inflight_decoding(server, tiny_hf_dir, other_ckpt):
    """Writer lock: a request running when an update arrives finishes entirely on the old weights
    (its log-probs match the old model token for token) and carries the old version."""
    from transformers import AutoModelForCausalLM

    url = server.url
    assert http(url + "/update_weights_from_disk", {"model_path": str(tiny_hf_dir), "weight_version": "old"})[0] == 200
    prompt = [41, 42]
    fut = bg(url + "/generate", {"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}})
    wait_running(url, 1)
    update = bg(url + "/update_weights_from_disk", {"model_path": str(other_ckpt), "weight_version": "new"})
    status, out = fut.result(timeout=120)
    assert status == 200 and out["meta_info"]["weight_version"] == "old"
    assert update.result(timeout=120)[0] == 200
    old = AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(old(input_ids=torch.tensor([prompt + out["output_ids"]])).logits[0], dim=-1)
    expected = [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(out["output_ids"])]
    got = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-4, rtol=0)
    assert http(url + "/update_weights_from_disk", {"model_path": str(tiny_hf_dir)})[0] == 200


def test_stress_aborts_pauses_and_updates_lose_nothing(server, tiny_hf_dir):
    """Many concurrent requests while rids are aborted and the server is paused in every mode and
    updated: every call returns 200 with a consistent reply, and the server ends idle."""
    import random

    url, rng = server.url, random.Random(0)
    bodies = [{"input_ids": [rng.randrange(3, 300) for _ in range(rng.randrange(1, 20))], "rid": f"stress_{i:03d}",
               "return_logprob": True,
               "sampling_params": {"max_new_tokens": rng.choice([1, 5, 40, 300]), "ignore_eos": True,
                                   "temperature": rng.choice([0.0, 1.0])}} for i in range(24)]
    futs = [POOL.submit(http, url + "/generate", b) for b in bodies[:8]]
    stress_pool = ThreadPoolExecutor(16)
    futs += [stress_pool.submit(http, url + "/generate", b) for b in bodies[8:]]
    for step, mode in enumerate(["retract", "in_place", "abort", "retract"]):
        http(url + "/abort_request", {"rid": f"stress_{rng.randrange(24):03d}"})
        assert http(url + "/pause_generation", {"mode": mode})[0] == 200
        update = {"model_path": str(tiny_hf_dir), "weight_version": f"s{step}", "flush_cache": mode != "in_place"}
        assert http(url + "/update_weights_from_disk", update)[0] == 200
        assert http(url + "/continue_generation", {})[0] == 200
    for body, fut in zip(bodies, futs):
        status, out = fut.result(timeout=300)
        assert status == 200, out
        meta, limit = out["meta_info"], body["sampling_params"]["max_new_tokens"]
        assert meta["id"] == body["rid"] and len(out["output_ids"]) <= limit
        assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
        reason = meta["finish_reason"]
        assert reason["type"] in ("length", "abort")
        if reason["type"] == "length":
            assert len(out["output_ids"]) == limit == reason["length"]
    stress_pool.shutdown()
    wait_idle(url)
    assert http(url + "/flush_cache")[0] == 200


def test_arbitrary_control_bodies_get_200_or_400_never_500(server):
    """Property: any JSON to the control endpoints is a 200 or a 400 (never a 500), and afterwards
    the server still generates. (init_weights_update_group is left out: a valid body rendezvouses.)"""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    url = server.url
    values = st.one_of(st.none(), st.booleans(), st.integers(-2, 3), st.text(max_size=6),
                       st.sampled_from(["abort", "retract", "in_place", "/nonexistent", "float32"]),
                       st.lists(st.integers(0, 3), max_size=2))
    keys = st.sampled_from(["rid", "abort_all", "mode", "new_version", "abort_all_requests", "model_path",
                            "weight_version", "names", "dtypes", "shapes", "group_name", "load_format", "tags"])
    endpoints = st.sampled_from(["/abort_request", "/flush_cache", "/pause_generation", "/continue_generation",
                                 "/update_weight_version", "/update_weights_from_disk",
                                 "/update_weights_from_distributed", "/destroy_weights_update_group",
                                 "/release_memory_occupation", "/resume_memory_occupation",
                                 "/update_weights_from_tensor"])
    bodies = st.one_of(st.dictionaries(keys, values, max_size=4), values)

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(endpoints, bodies)
    def check(endpoint, body):
        status, out = http(url + endpoint, body, timeout=60)
        assert status in (200, 400), (endpoint, body, status, out)
        http(url + "/continue_generation", {})

    check()
    assert http(url + "/continue_generation", {})[0] == 200
    assert http(url + "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})[0] == 200


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_update_under_pause_labels_each_token_with_the_weights_that_produced_it(server, tiny_hf_dir, other_ckpt, mode):
    """A request running across a weight update (pause in `mode`, update, continue: the asynchronous
    trainer's in-flight sync): `weight_versions` spans (SGLang 0.5.23's format) say which version
    produced each token, the client turns them into per-token versions, and each token's log-prob is
    the one its version computed (after a retract the new weights re-prefill the whole prefix)."""
    from transformers import AutoModelForCausalLM

    from megatron_bapo.rollout.protocol import parse_generate_reply
    from server_helpers import ref_logprobs

    url, prompt, num = server.url, [7, 8, 9], 800
    assert http(url + "/update_weights_from_disk", {"model_path": str(tiny_hf_dir), "weight_version": "10"})[0] == 200
    fut = bg(url + "/generate", {"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "max_new_tokens": num, "temperature": 0, "ignore_eos": True}})
    wait_running(url, 1)
    assert http(url + "/pause_generation", {"mode": mode})[0] == 200
    # A request holds KV while paused in place: the update must not ask for a flush (SGLang refuses it).
    status, reply = http(url + "/update_weights_from_disk", {"model_path": str(other_ckpt), "weight_version": "11",
                                                             "flush_cache": mode != "in_place"})
    assert status == 200, reply
    assert http(url + "/continue_generation", {})[0] == 200
    status, out = fut.result(timeout=120)
    assert status == 200
    spans = out["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["10", "11"], spans
    k = spans[0]["end"]
    assert spans[0]["start"] == 0 and spans[1]["start"] == k and spans[1]["end"] == num and 0 < k < num
    result = parse_generate_reply(out, rid="r", url=url)
    assert result.versions == [10] * k + [11] * (num - k)
    ids, lps = out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    old = ref_logprobs(AutoModelForCausalLM.from_pretrained(tiny_hf_dir).eval(), prompt, ids)
    new = ref_logprobs(AutoModelForCausalLM.from_pretrained(other_ckpt).eval(), prompt, ids)
    assert lps[:k] == pytest.approx(old[:k], abs=1e-4)
    if mode == "retract":
        assert lps[k:] == pytest.approx(new[k:], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(lps[k:], old[k:])) > 1e-2  # the new weights really produced them
    assert http(url + "/update_weights_from_disk", {"model_path": str(tiny_hf_dir), "weight_version": "v1"})[0] == 200


def test_flush_while_paused_in_place_is_refused(server, tiny_hf_dir, other_ckpt):
    """SGLang 0.5.23: paused in place, requests keep their KV, so `/flush_cache` is a 400 and an update
    that asks for its flush (`flush_cache` defaults to true) loads the weights but answers
    success=false, 400. The project's client before this change sent the default: this is what it met.
    With `flush_cache: false` the update succeeds; after continue and idle a flush works."""
    url = server.url
    fut = bg(url + "/generate", {"input_ids": [3, 4, 5], "sampling_params": LONG})
    wait_running(url, 1)
    assert http(url + "/pause_generation", {"mode": "in_place"})[0] == 200
    status, text = http(url + "/flush_cache", {})
    assert status == 400
    status, reply = http(url + "/update_weights_from_disk", {"model_path": str(other_ckpt), "weight_version": "f1"})
    assert status == 400 and reply["success"] is False and "cache was not flushed" in reply["message"]
    assert http(url + "/model_info", method="GET")[1]["weight_version"] == "f1"  # loaded all the same, as SGLang
    status, reply = http(url + "/update_weights_from_disk", {"model_path": str(tiny_hf_dir), "weight_version": "f2",
                                                             "flush_cache": False})
    assert status == 200 and reply["success"] is True, reply
    assert http(url + "/abort_request", {"abort_all": True})[0] == 200
    assert http(url + "/continue_generation", {})[0] == 200
    assert fut.result(timeout=120)[0] == 200
    wait_idle(url)
    assert http(url + "/flush_cache", {})[0] == 200


@pytest.mark.slow
def test_sampling_seed_is_ignored_without_deterministic_inference(tiny_hf_dir):
    """SGLang honours `sampling_seed` only under --enable-deterministic-inference; the built-in server
    too, so a client cannot rely on seeds the real server would ignore."""
    body = {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 12, "sampling_seed": 11, "temperature": 2.0}}
    outs = {}
    for flag in ((), ("--enable-deterministic-inference",)):
        with start_server(tiny_hf_dir, extra_args=["--num-threads", "1", *flag]) as s:
            outs[flag] = [http(s.url + "/generate", body)[1]["output_ids"] for _ in range(4)]
            assert http(s.url + "/server_info", method="GET")[1]["enable_deterministic_inference"] is bool(flag)
    assert all(o == outs[("--enable-deterministic-inference",)][0] for o in outs[("--enable-deterministic-inference",)])
    assert len({tuple(o) for o in outs[()]}) > 1


def test_the_client_completes_an_update_whose_flush_met_a_request(server, tiny_hf_dir, other_ckpt):
    """SGLang answers an update whose own flush met a request in its scheduler with 400 "Weights were
    updated, but the cache was not flushed" (live SGLang once: an update right after a weight check's
    probes). The weights are in; the client flushes again until the server is idle, as the reply
    asks, rather than failing the sync (before: a RolloutError at once). Here the request is paused in
    place until the test lets it go."""
    from megatron_bapo.rollout import RolloutClient, RolloutClientConfig

    url = server.url
    fut = bg(url + "/generate", {"input_ids": [3, 4, 5], "sampling_params": LONG})
    wait_running(url, 1)
    assert http(url + "/pause_generation", {"mode": "in_place"})[0] == 200
    with RolloutClient(RolloutClientConfig(urls=[url], flush_cache_timeout_s=60)) as client:
        update = POOL.submit(client.update_weights_from_disk, str(other_ckpt), 7)
        wait_for(lambda: http(url + "/model_info", method="GET")[1]["weight_version"] == "7", "the update to load")
        assert http(url + "/flush_cache", {})[0] == 400  # the request still holds KV: the update's flush was refused
        assert http(url + "/abort_request", {"abort_all": True})[0] == 200
        assert http(url + "/continue_generation", {})[0] == 200
        update.result(timeout=60)  # the client's flush went through once the server was idle
    assert fut.result(timeout=120)[0] == 200
    wait_idle(url)
    assert http(url + "/update_weights_from_disk", {"model_path": str(tiny_hf_dir), "weight_version": "v1"})[0] == 200
