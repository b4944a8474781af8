"""The server behaviours the trainer relies on, checked against live SGLang and the built-in server.

Every test runs on both engines (`builtin`: `python -m megatron_bapo.server`; `sglang`: SGLang's
own `sglang.launch_server` on CPU, from `.venv-sglang`), one server per engine for the module,
started (and restarted) by the run's own `ServerPool` (`rollout.engine`) with an API key. Tokens,
log-probs and versions are checked against a transformers forward of the weights the server should
be serving (a teacher's prefill log-probs and its restart mid-scoring too: `teacher_contract.py`, run
last). The in_place pause needs a server without radix cache: `tests/test_server_contract_inplace.py`.
"""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from contract_helpers import ENGINES, LONG, MAX_TOTAL_TOKENS, PROMPT, Served, check_logprobs
from megatron_bapo.rollout.errors import RolloutError

pytestmark = pytest.mark.slow
CORRUPTED = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("model_b"), seed=1)


@pytest.fixture(scope="module")
def corrupted(model_b, tmp_path_factory):
    """model_b with one tensor zeroed (`model.layers.1.mlp.down_proj.weight`): a server given it serves
    wrong weights under a right version."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("corrupted") / "model"
    shutil.copytree(model_b, path)
    weights = load_file(str(path / "model.safetensors"))
    weights[CORRUPTED] = torch.zeros_like(weights[CORRUPTED])
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=ENGINES)
def served(request, tiny_hf_dir, model_b, tmp_path_factory):
    server = Served(request.param, tiny_hf_dir, model_b, tmp_path_factory.mktemp(f"logs_{request.param}"))
    yield server
    server.close()


def greedy(served: Served, prompt: list[int], num: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num):
            ids.append(int(served.reference()(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_generate_returns_each_tokens_log_prob_and_version(served):
    for temperature in (1.0, 0.6):
        r = served.client.generate(PROMPT, {"max_new_tokens": 8, "temperature": temperature, "ignore_eos": True})
        assert r.finish_type == "length" and r.finish_reason.get("length") == 8 and len(r.output_ids) == 8
        assert r.versions == [served.version] * 8
        check_logprobs(served, PROMPT, r, temperature=temperature)
    r = served.client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})
    assert r.output_ids == greedy(served, PROMPT, 8)
    check_logprobs(served, PROMPT, r, temperature=1.0)  # greedy reports the temperature-1 log-probs


def test_a_response_continues_across_segments(served):
    """Partial rollout: a segment resumed with prompt + tokens so far continues the same response."""
    params = {"temperature": 0.0, "ignore_eos": True}
    whole = served.client.generate(PROMPT, {**params, "max_new_tokens": 8})
    first = served.client.generate(PROMPT, {**params, "max_new_tokens": 3})
    second = served.client.generate(PROMPT + first.output_ids, {**params, "max_new_tokens": 5})
    assert first.finish_type == second.finish_type == "length"
    assert first.output_ids + second.output_ids == whole.output_ids
    check_logprobs(served, PROMPT + first.output_ids, second)  # only the new tokens, given the whole prefix
    sampled = served.client.generate(PROMPT, {"max_new_tokens": 3, "temperature": 1.0})
    more = served.client.generate(PROMPT + sampled.output_ids, {"max_new_tokens": 4, "temperature": 1.0,
                                                                 "ignore_eos": True})
    check_logprobs(served, PROMPT + sampled.output_ids, more)


def test_a_budget_that_ends_on_a_stop_id_finishes_as_stop(served):
    """SGLang 0.5.23 checks stop ids before the length budget: a response whose max_new_tokens ends
    exactly on a stop id is "stop" (the partial-rollout manager would otherwise resume it past it)."""
    free = served.client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0.0}).output_ids  # may end on EOS
    k = max(i for i in range(len(free)) if free[i] not in free[:i])  # the last token not seen before it
    r = served.client.generate(PROMPT, {"max_new_tokens": k + 1, "temperature": 0.0, "stop_token_ids": [free[k]]})
    assert r.output_ids == free[:k + 1] and r.finish_reason == {"type": "stop", "matched": free[k]}, r.finish_reason


def test_abort_all_returns_every_request_with_its_partial_tokens(served):
    requests = served.long_requests(3)
    served.client.abort_all()
    for prompt, future in requests:
        r = future.result(60)
        assert r.finish_type == "abort" and 0 < len(r.output_ids) < LONG
        assert r.versions == [served.version] * len(r.output_ids)
        check_logprobs(served, prompt, r)


def test_abort_request_stops_only_its_own_rid(served):
    rids = [uuid.uuid4().hex for _ in range(2)]
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": LONG // 4, "temperature": 1.0, "ignore_eos": True},
            "return_logprob": True}
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(served.http, "POST", "/generate", {**body, "rid": rid}, timeout=300) for rid in rids]
        while served.num_running() < 2:
            assert not any(f.done() for f in futures), [f.result() for f in futures]
            time.sleep(0.02)
        status, text = served.http("POST", "/abort_request", {"rid": rids[0]})
        assert status == 200, text
        (status_a, a), (status_b, b) = (f.result(300) for f in futures)
    assert status_a == status_b == 200
    a, b = json.loads(a), json.loads(b)
    assert a["meta_info"]["finish_reason"]["type"] == "abort" and len(a["output_ids"]) < LONG // 4
    assert b["meta_info"]["finish_reason"]["type"] == "length" and len(b["output_ids"]) == LONG // 4


def test_the_abort_pause_returns_requests_and_holds_new_ones_until_continue(served):
    requests = served.long_requests(2)
    served.client.pause_generation("abort")
    try:
        for prompt, future in requests:  # the pause returns once they all returned
            r = future.result(30)
            assert r.finish_type == "abort" and len(r.output_ids) < LONG
            check_logprobs(served, prompt, r)
        late = served.client.submit(served.client.agenerate(PROMPT, {"max_new_tokens": 4, "temperature": 1.0}))
        with pytest.raises(TimeoutError):
            late.result(timeout=2.0)  # held at the pause gate
    finally:
        served.client.continue_generation()
    r = late.result(60)
    assert r.finish_type in ("length", "stop") and r.versions == [served.version] * len(r.output_ids)


def test_the_retract_pause_lets_an_update_land_under_running_requests(served):
    """The trainer's disk sync under `sync.pause_mode=retract` (pause, load with a flush, continue):
    requests keep running across it, and every token carries the version, and the log-prob, of the
    weights that produced it."""
    start = served.load(served.model_a)
    requests = served.long_requests(2, max_new_tokens=200)
    new = served.load(served.model_b, pause_mode="retract")
    for prompt, future in requests:
        r = future.result(120)
        assert r.finish_type == "length" and len(r.output_ids) == 200
        split = r.versions.index(new)
        assert split > 0 and r.versions == [start] * split + [new] * (200 - split)
        before = served.ref_logprobs(prompt, r.output_ids, path=served.model_a)[:split]
        after = served.ref_logprobs(prompt, r.output_ids, path=served.model_b)[split:]
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), torch.cat([before, after]),
                                   atol=1e-4, rtol=0)


def test_a_disk_update_serves_the_new_weights_and_a_bad_one_changes_nothing(served):
    served.load(served.model_a)
    version = served.load(served.model_b)
    assert served.client.get_weight_version() == version
    r = served.client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True})
    assert r.versions == [version] * 6
    check_logprobs(served, PROMPT, r, path=served.model_b)
    with pytest.raises(RolloutError, match="update_weights_from_disk failed"):
        served.load(served.log_dir / "no_such_checkpoint")
    assert served.version == version and served.client.get_weight_version() == version
    r = served.client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True})
    check_logprobs(served, PROMPT, r, path=served.model_b)


def test_a_distributed_update_over_gloo_lands_inside_a_begin_end_session(served):
    """The distributed sync's protocol, by hand: the group, a refused update outside a session, two
    buckets inside one (the version changes with the last), the group left on both sides."""
    from safetensors.torch import load_file

    from megatron_bapo.rollout.pool import ServedWeights
    from megatron_bapo.rollout.weight_group import DistributedWeightSender
    from megatron_bapo.weight_update import update_request_body

    served.load(served.model_b)
    named = sorted(load_file(str(served.model_a / "model.safetensors")).items())
    client = served.client
    sender = DistributedWeightSender(client, backend="gloo", timeout_s=120)
    sender.connect([1])
    try:
        # Outside a session the update is refused before the server joins a broadcast.
        status, text = served.http("POST", "/update_weights_from_distributed",
                                   update_request_body(named[:1], group_name=sender.group_name))
        assert status == 400 and json.loads(text)["success"] is False, text
        version = served.version + 1
        client.run(client.abegin_weight_update())
        half = len(named) // 2
        sender.send(named[:half], flush_cache=False)
        assert client.get_weight_version() == served.version  # a partial update reports no new version
        sender.send(named[half:], weight_version=str(version), flush_cache=True)
        client.run(client.aend_weight_update())
    finally:
        sender.close()
    served.pool.served = ServedWeights(version, str(served.model_a))  # what this test delivered by hand
    assert client.get_weight_version() == version
    r = client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True})
    assert r.versions == [version] * 6
    check_logprobs(served, PROMPT, r, path=served.model_a)


def test_the_cache_flushes_only_when_idle(served):
    status, text = served.http("POST", "/flush_cache")
    assert status == 200, text
    requests = served.long_requests(1)
    status, text = served.http("POST", "/flush_cache")
    assert status == 400, text  # a request holds KV
    served.client.abort_all()
    for _, future in requests:
        future.result(60)
    served.client.flush_cache()  # polls until the server is idle again


def test_the_servers_run_as_the_config_says(served):
    """What the pool launched with reaches the server: seed, dtype, KV size, the version, no flag
    this config does not ask for, the API key on everything but SGLang's open /health paths."""
    info = served.client.run(served.client.aget_server_info())[served.url]
    assert (info["tp_size"], info.get("pp_size", 1), info.get("dp_size", 1)) == (1, 1, 1)
    assert info["random_seed"] == 0 and info["dtype"] == "float32"
    # Launch arguments, as launched: the served version and weights are /model_info's.
    assert str(info["weight_version"]) == "0" and info["model_path"] == str(served.model_a)
    assert str(json.loads(served.http("GET", "/model_info")[1])["weight_version"]) == str(served.version)
    assert info["enable_deterministic_inference"] is False
    if served.engine == "sglang":  # the built-in server keeps no prefix cache at all (server/README.md)
        assert info["disable_radix_cache"] is False and info["max_total_num_tokens"] == MAX_TOTAL_TOKENS
        assert info["mem_fraction_static"] == 0.1 and info["device"] == "cpu"
    assert served.http("POST", "/generate", {"input_ids": PROMPT}, key=None)[0] == 401
    assert served.http("POST", "/generate", {"input_ids": PROMPT}, key="wrong")[0] == 401
    assert served.http("GET", "/health", key=None)[0] == 200
    assert served.http("GET", "/health_generate", key=None)[0] == 200  # open on SGLang (its /health prefix)
    assert served.http("GET", "/get_weight_version")[0] == 404  # gone in 0.5.23: versions are /model_info's
    # An update outside a session is refused first, even with no weight group (SGLang's order).
    status, text = served.http("POST", "/update_weights_from_distributed", {
        "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "nonexistent"})
    assert status == 400 and json.loads(text) == {
        "success": False, "message": "update_weights_from_distributed must run between begin_weight_update() and "
                                     "end_weight_update()"}
    status, text = served.http("POST", "/destroy_weights_update_group", {"group_name": "nonexistent"})
    assert status == 400 and json.loads(text) == {"success": False, "message": "The group to be destroyed does not exist."}


def test_weights_checker_reports_sglangs_layout_and_hashes_of_the_served_weights(served):
    """`/weights_checker {"action": "checksum"}`: one engine rank, SGLang's tensor names (fused qkv_proj and
    gate_up_proj, no tied head) and its CPU hash of each, equal to what the trainer computes from the
    checkpoint it sent (`sync.verify.ExpectedChecksums`); skip_tensor_list leaves tensors out."""
    from megatron_bapo.convert.served_layout import overall_checksum
    from megatron_bapo.sync.verify import ExpectedChecksums

    served.load(served.model_b)
    status, text = served.http("POST", "/weights_checker", {"action": "checksum"})
    assert status == 200, text
    reply = json.loads(text)
    assert reply["success"] is True and len(reply["ranks"]) == 1
    rank = reply["ranks"][0]
    assert rank["parallelism_info"] == [{"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
                                         "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}]
    config = json.loads((served.model_b / "config.json").read_text())
    expected = ExpectedChecksums.of_directory(served.model_b, config, torch.float32, "cpu").checksums
    assert rank["checksums"] == expected and "model.layers.0.self_attn.qkv_proj.bias" in expected
    assert "lm_head.weight" not in expected and "model.layers.0.self_attn.q_proj.weight" not in expected
    assert rank["per_gpu_checksum"] == overall_checksum(expected)
    status, text = served.http("POST", "/weights_checker", {"action": "checksum", "skip_tensor_list": ["mlp."]})
    assert status == 200 and not any("mlp." in n for n in json.loads(text)["ranks"][0]["checksums"]), text


@pytest.mark.parametrize("mode", ["probe", "checksum"])
def test_a_server_given_a_corrupted_tensor_fails_the_weight_check(served, corrupted, mode):
    """`sync.verify`: after an update the server passes the pool's check; given one corrupted tensor under
    the same version (behind the pool's back) it fails, naming the probe KL or the tensor."""
    served.verify_with(mode)
    try:
        version = served.load(served.model_b, probe=served.probe(served.model_b))
        assert served.pool.verifier.check(served.client, [served.url]) == {}
        served.client.update_weights_from_disk(str(corrupted), version)
        failures = served.pool.verifier.check(served.client, [served.url])
    finally:
        served.verify_with("off")
    assert list(failures) == [served.url]
    if mode == "probe":
        assert failures[served.url].startswith("probe KL ") and "over 31 tokens > 1e-10" in failures[served.url]
    else:
        assert failures[served.url].startswith(f"tensor {CORRUPTED} differs") and "1 of 16" in failures[served.url]
    served.load(served.model_b)


def test_evaluation_samples_what_the_model_decodes(served, tmp_path):
    """`eval.run_evaluation` through the server at temperature 0 scores what greedy decoding of the
    served weights says."""
    from transformers import AutoTokenizer

    from megatron_bapo.eval.config import EvalConfig, EvalDatasetConfig
    from megatron_bapo.eval.runner import prompt_to_ids, run_evaluation
    from megatron_bapo.tiny.task import make_problem, write_jsonl

    problems = [make_problem(a, b) for a, b in ((12, 30), (7, 45), (99, 1), (56, 38))]
    write_jsonl(problems, tmp_path / "eval.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(str(served.model_a))
    config = EvalConfig(datasets=[EvalDatasetConfig(name="tiny", path=str(tmp_path / "eval.jsonl"))], n=1,
                        temperature=0.0, max_new_tokens=6, reward="arithmetic")
    metrics = served.client.run(run_evaluation(served.client, tokenizer, config, output_dir=tmp_path))
    records = [json.loads(line) for line in (tmp_path / "tiny.jsonl").read_text().splitlines()]
    assert metrics["eval/tiny/num_problems"] == 4 and len(records) == 4
    for problem, record in zip(problems, records):
        ids = greedy(served, prompt_to_ids(tokenizer, problem["prompt"]), 6)
        if tokenizer.eos_token_id in ids:
            ids = ids[:ids.index(tokenizer.eos_token_id)]
        assert record["responses"][0]["text"] == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_sigkilled_server_is_restarted_by_the_pool_with_the_current_weights(served):
    """Last in the module: the server is replaced. The pool restarts a crashed server on its port
    (the client's URL stays valid) and gives it the served version from its directory."""
    version = served.load(served.model_b)
    old_pid = served.pool.servers[0].pid
    served.kill()
    with pytest.raises(RolloutError):
        served.client.generate(PROMPT, {"max_new_tokens": 2})
    assert served.pool.ensure_alive() == [served.url]
    assert served.pool.servers[0].pid != old_pid and served.pool.restarts == [1]
    assert served.client.get_weight_version() == version
    r = served.client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True})
    assert r.versions == [version] * 6
    check_logprobs(served, PROMPT, r, path=served.model_b)


def test_a_restarted_server_on_the_checkpoints_weights_is_caught_before_its_first_generation(served, tmp_path):
    """`sync.verify=probe`: a server that came back on the checkpoint's (older) weights (here the version's
    directory holds them) is checked by the restart, before any request reaches it, and the run stops in
    one line naming the server, the KL and the version (one restart left: `rollout.max_server_restarts`)."""
    import shutil

    from megatron_bapo.sync.verify import WeightCheckError

    version_dir = tmp_path / "v"
    shutil.copytree(served.model_b, version_dir)
    served.verify_with("probe")
    budget = served.pool.rollout.max_server_restarts
    try:
        version = served.load(version_dir, probe=served.probe(served.model_b))
        shutil.copy(served.model_a / "model.safetensors", version_dir / "model.safetensors")
        served.pool.rollout.max_server_restarts = served.pool.restarts[0] + 1  # the crash's restart only
        requests = served.client.stats["num_requests"]
        served.kill()
        with pytest.raises((WeightCheckError, RolloutError)) as caught:
            served.pool.ensure_alive()
        assert served.client.stats["num_requests"] == requests  # nothing generated on it
    finally:
        served.pool.rollout.max_server_restarts = budget
        served.verify_with("off")
    message = str(caught.value)
    assert "\n" not in message and served.url in message and "probe KL" in message, message
    assert f"weight check of version {version}" in message and "max_server_restarts" in message, message


def test_what_a_dead_trainer_left_is_cleared_before_the_next_join(served):
    """Servers outlive trainers: one killed mid-update leaves its weight group and an open update
    session on the server. A join under that name is refused at once (the server's reply ends the wait,
    not `sync.group_timeout_s`); the pool's clearing (`aclear_weight_group`, what `ServerPool` runs before
    every join) ends the session and destroys the group, and the next trainer joins and updates."""
    from safetensors.torch import load_file

    from megatron_bapo.rollout.pool import ServedWeights
    from megatron_bapo.rollout.weight_group import DistributedWeightSender
    from megatron_bapo.weight_update import DEFAULT_GROUP, destroy_weights_update_group

    client = served.client
    dead = DistributedWeightSender(client, backend="gloo", timeout_s=120)
    dead.connect([1])
    client.run(client.abegin_weight_update())
    destroy_weights_update_group(dead.pg)  # the trainer dies: its own side goes, the server keeps its side
    dead.pg = None
    started = time.monotonic()
    with pytest.raises(RolloutError, match="refused to join"):
        DistributedWeightSender(client, backend="gloo", timeout_s=120).connect([1])
    assert time.monotonic() - started < 60
    held = client.run(client.aclear_weight_group(DEFAULT_GROUP))
    assert held == {served.url: ["an open weight-update session", f"the weight group {DEFAULT_GROUP!r}"]}, held
    assert client.run(client.aclear_weight_group(DEFAULT_GROUP)) == {served.url: []}  # a clean server holds nothing
    served.load(served.model_b)
    named = sorted(load_file(str(served.model_a / "model.safetensors")).items())
    sender = DistributedWeightSender(client, backend="gloo", timeout_s=120)
    sender.connect([1])
    version = served.version + 1
    try:
        client.run(client.abegin_weight_update())
        sender.send(named, weight_version=str(version), flush_cache=True)
        client.run(client.aend_weight_update())
    finally:
        sender.close()
    served.pool.served = ServedWeights(version, str(served.model_a))
    r = client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True})
    assert r.versions == [version] * 6
    check_logprobs(served, PROMPT, r, path=served.model_a)


# The teacher's side of the contract (`teacher_contract.py`): collected here, last, on this module's servers.
from teacher_contract import test_teacher_prefill_log_probs_equal_a_transformers_forward  # noqa: E402,F401,I001
from teacher_contract import test_a_teacher_server_killed_mid_scoring_is_restarted_and_the_scoring_retried  # noqa
from teacher_contract import test_a_judge_generation_is_accepted_and_parsed  # noqa: E402,F401,I001

