"""Built-in server `/generate` over real loopback HTTP against a tiny random model.

The reference is a direct transformers forward over the same tokens in this process: the server's
returned log-probs must match it (temperature 1), batched/concurrent decoding must give the same
greedy tokens as one request alone, and every finish reason / reply shape must be SGLang's.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron_bapo.server.launch import start_server
from server_helpers import http, ref_logprobs



@pytest.fixture(scope="module")
def server(tiny_hf_dir):
    with start_server(tiny_hf_dir, extra_args=["--num-threads", "1", "--random-seed", "3",
                                              "--enable-deterministic-inference"]) as handle:
        yield handle


@pytest.fixture(scope="module")
def ref_model(tiny_hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(tiny_hf_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_hf_dir)



def ref_greedy(model, prompt: list, num: int) -> list:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [9], [70, 71, 72, 73, 74]]


def test_logprobs_match_direct_forward_under_concurrency(server, ref_model):
    """Sampled at temperature 1 from 8 concurrent requests of different lengths (joined/left batches)."""
    bodies = [{"input_ids": PROMPTS[i % 4], "return_logprob": True,
               "sampling_params": {"max_new_tokens": 6 + 3 * i, "temperature": 1.0, "ignore_eos": True}}
              for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda b: http(server.url + "/generate", b), bodies))
    for body, (status, out) in zip(bodies, replies):
        assert status == 200, out
        meta = out["meta_info"]
        lps = meta["output_token_logprobs"]
        assert [e[1] for e in lps] == out["output_ids"]
        assert len(out["output_ids"]) == body["sampling_params"]["max_new_tokens"] == meta["completion_tokens"]
        assert meta["finish_reason"] == {"type": "length", "length": body["sampling_params"]["max_new_tokens"]}
        assert meta["prompt_tokens"] == len(body["input_ids"])
        assert meta["input_token_logprobs"] == []
        expected = ref_logprobs(ref_model, body["input_ids"], out["output_ids"])
        torch.testing.assert_close(torch.tensor([e[0] for e in lps]), torch.tensor(expected), atol=1e-4, rtol=0)


def test_batched_greedy_equals_single_and_reference(server, ref_model):
    sp = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    status, batch = http(server.url + "/generate", {"input_ids": PROMPTS, "sampling_params": sp})
    assert status == 200 and isinstance(batch, list) and len(batch) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, batch):
        status, single = http(server.url + "/generate", {"input_ids": prompt, "sampling_params": sp})
        assert status == 200 and isinstance(single, dict)
        assert out["output_ids"] == single["output_ids"] == ref_greedy(ref_model, prompt, 12)


def test_input_logprobs_and_top_logprobs(server, ref_model):
    prompt = PROMPTS[1]
    status, out = http(server.url + "/generate", {
        "input_ids": prompt, "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 3,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert status == 200, out
    meta = out["meta_info"]
    inp = meta["input_token_logprobs"]
    assert [e[1] for e in inp] == prompt[2:] and inp[0][0] is None
    with torch.no_grad():
        lp = torch.log_softmax(ref_model(input_ids=torch.tensor([prompt])).logits[0], dim=-1)
    for pos in range(3, len(prompt)):
        assert abs(inp[pos - 2][0] - float(lp[pos - 1, prompt[pos]])) < 1e-4
    tops = meta["output_top_logprobs"]
    assert len(tops) == 3 and all(len(t) == 3 for t in tops)
    # greedy: the chosen token is the most likely one
    assert [t[0][1] for t in tops] == out["output_ids"]


def test_finish_reasons_and_trimming(server, tok):
    prompt = tok("abc")["input_ids"]
    base = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    _, ref = http(server.url + "/generate", {"input_ids": prompt, "sampling_params": base})
    ids = ref["output_ids"]
    # stop token id: the 4th greedy token (first occurrence)
    stop_tok = ids[3]
    first = ids.index(stop_tok)
    _, out = http(server.url + "/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 10, "temperature": 0, "stop_token_ids": [stop_tok]}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert out["output_ids"] == ids[: first + 1]  # the stop token is kept in output_ids
    assert out["text"] == tok.decode(ids[:first], skip_special_tokens=True)  # ...and trimmed from text
    # stop string: text of greedy tokens 2..3
    full_text = tok.decode(ids, skip_special_tokens=True)
    stop_str = full_text[2:4]
    _, out = http(server.url + "/generate", {"input_ids": prompt, "sampling_params": {**base, "stop": [stop_str]}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
    assert out["text"] == full_text[: full_text.find(stop_str)]
    _, kept = http(server.url + "/generate", {"input_ids": prompt, "sampling_params": {
        **base, "stop": stop_str, "no_stop_trim": True}})
    assert kept["text"].endswith(stop_str)
    # min_new_tokens keeps the stop token from ending the sequence early
    _, out = http(server.url + "/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 10, "min_new_tokens": 10, "temperature": 0, "stop_token_ids": [stop_tok]}})
    assert out["meta_info"]["finish_reason"]["type"] == "length" and stop_tok not in out["output_ids"]
    # a budget that ends on the stop token or a stop string is a stop (SGLang 0.5.23 checks stops before length)
    _, out = http(server.url + "/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": first + 1, "temperature": 0, "stop_token_ids": [stop_tok]}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}, out["meta_info"]
    at = next(n for n in range(1, len(ids) + 1) if stop_str in tok.decode(ids[:n], skip_special_tokens=True))
    _, out = http(server.url + "/generate", {"input_ids": prompt, "sampling_params": {
        **base, "max_new_tokens": at, "stop": [stop_str]}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}, out["meta_info"]
    # max_new_tokens = 0: no tokens, length 0
    _, out = http(server.url + "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_eos_stops_unless_ignored(server, tok, ref_model):
    """Force EOS with a logit bias: it stops (matched = eos id) unless ignore_eos."""
    eos = tok.eos_token_id
    sp = {"max_new_tokens": 5, "temperature": 0, "logit_bias": {str(eos): 1000.0}}
    _, out = http(server.url + "/generate", {"input_ids": [5, 6], "sampling_params": sp})
    assert out["output_ids"] == [eos] and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert out["text"] == ""
    _, out = http(server.url + "/generate", {"input_ids": [5, 6], "sampling_params": {**sp, "ignore_eos": True}})
    assert out["output_ids"] == [eos] * 5 and out["meta_info"]["finish_reason"]["type"] == "length"


def test_n_batch_rids_text_and_seed(server, tok):
    status, out = http(server.url + "/generate", {"text": ["ab", "xyz"], "rid": "grp",
                                                 "sampling_params": {"max_new_tokens": 4, "n": 3}})
    assert status == 200 and len(out) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(tok("ab")["input_ids"])] * 3 + [
        len(tok("xyz")["input_ids"])] * 3
    assert len({o["meta_info"]["id"] for o in out}) == 6  # n > 1: fresh rids per sample
    status, out = http(server.url + "/generate", {"input_ids": [[1, 2], [3, 4]], "rid": "b",
                                                 "sampling_params": {"max_new_tokens": 2}})
    assert [o["meta_info"]["id"] for o in out] == ["b_0", "b_1"]
    seeded = {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 8, "sampling_seed": 11, "temperature": 1.5}}
    _, a = http(server.url + "/generate", seeded)
    _, b = http(server.url + "/generate", seeded)
    assert a["output_ids"] == b["output_ids"]


@pytest.mark.parametrize("body,needle", [
    ({"input_ids": []}, "empty"),
    ({"input_ids": [1, 2], "sampling_params": {"bogus": 1}}, "bogus"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0.0}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1] * 600}, "context length"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 600}}, "context length"),
    ({"input_ids": [1, 10 ** 7]}, "vocabulary"),
    ({"sampling_params": {}}, "input_ids"),
    ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid"),
    ({"input_ids": [1, 2], "logprob_start_len": 5, "return_logprob": True}, "logprob_start_len"),
])
def test_bad_requests_get_400_with_message(server, body, needle):
    status, out = http(server.url + "/generate", body)
    assert status == 400, out
    assert needle.lower() in out["error"]["message"].lower()


def test_bad_json_and_wrong_types_get_shape_2_and_server_keeps_serving(server):
    status, out = http(server.url + "/generate", raw=b"{not json")
    assert status == 400 and out["object"] == "error" and out["code"] == 400 and "JSON" in out["message"]
    status, out = http(server.url + "/generate", {"input_ids": ["a", "b"]})
    assert status == 400 and out["type"] == "Bad Request"
    status, out = http(server.url + "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and len(out["output_ids"]) == 2


def test_info_endpoints(server, tiny_hf_dir):
    status, info = http(server.url + "/get_model_info", method="GET")
    assert status == 200 and info["model_path"] == str(tiny_hf_dir) and info["weight_version"] == "default"
    assert info["architectures"] == ["Qwen2ForCausalLM"] and info["is_generation"] is True
    assert http(server.url + "/model_info", method="GET")[1] == info
    status, sinfo = http(server.url + "/server_info", method="GET")
    assert status == 200 and sinfo["context_length"] == 512 and sinfo["max_req_input_len"] == 511
    assert http(server.url + "/get_server_info", method="GET")[0] == 200
    assert http(server.url + "/get_weight_version", method="GET")[0] == 404  # removed in SGLang 0.5.23 (seen live)
    status, loads = http(server.url + "/v1/loads?include=core", method="GET")
    assert status == 200 and loads["loads"][0]["num_running_reqs"] == 0
    assert http(server.url + "/health", method="GET") == (200, None)
    assert http(server.url + "/health_generate", method="GET") == (200, None)
    assert http(server.url + "/release_memory_occupation", {}) == (200, None)
    assert http(server.url + "/resume_memory_occupation", {"tags": ["weights"]}) == (200, None)


def test_batched_prefill_rows_equal_single_forwards(ref_model):
    """Left-padded prefill of distinct contexts: each row's logits and KV equal its own forward."""
    from megatron_bapo.server.prefill import batched_prefill, chunk_by_tokens

    ctxs = [[5, 6, 7], list(range(40, 60)), [9]]
    with torch.no_grad():
        logits, layers, mask = batched_prefill(ref_model, ctxs)
        for i, ctx in enumerate(ctxs):
            out = ref_model(input_ids=torch.tensor([ctx]), use_cache=True)
            torch.testing.assert_close(logits[i], out.logits[0, -1], atol=1e-5, rtol=0)
            k_ref = out.past_key_values.layers[0].keys[0]
            torch.testing.assert_close(layers[0][0][i, :, -len(ctx):], k_ref, atol=1e-5, rtol=0)
            assert int(mask[i].sum()) == len(ctx) and float(layers[0][0][i, :, : 20 - len(ctx)].abs().sum()) == 0.0
    assert chunk_by_tokens([[1] * 10, [1] * 3, [1] * 30], max_tokens=40) == [[1, 0], [2]]


def test_logprob_distribution_at_other_temperatures_and_filters(server, ref_model):
    """Documented choice (SGLang's default): the log-prob is of the temperature-scaled distribution,
    before top-k/top-p filtering; top_k=1 / tiny top_p sample the argmax."""
    prompt = [50, 51, 52]

    def scaled_ref(output: list, temperature: float) -> list:
        with torch.no_grad():
            logits = ref_model(input_ids=torch.tensor([prompt + output])).logits[0] / temperature
        lp = torch.log_softmax(logits, dim=-1)
        return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]

    _, out = http(server.url + "/generate", {"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0.7, "ignore_eos": True}})
    got = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(scaled_ref(out["output_ids"], 0.7)), atol=1e-4, rtol=0)
    greedy_ids = ref_greedy(ref_model, prompt, 8)
    for sp in ({"top_k": 1}, {"top_p": 1e-6}):
        _, out = http(server.url + "/generate", {"input_ids": prompt, "return_logprob": True, "sampling_params": {
            "max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, **sp}})
        assert out["output_ids"] == greedy_ids
        got = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(scaled_ref(greedy_ids, 1.0)), atol=1e-4, rtol=0)


def test_engine_original_logprob_mode_in_process(tiny_hf_dir, ref_model):
    """`--return-original-logprob`: log-probs of the raw distribution even at temperature 0.5."""
    import threading

    from megatron_bapo.server.app import build_state
    from megatron_bapo.server.config import ServerConfig
    from megatron_bapo.server.protocol import GenerateItem, SamplingParams

    state = build_state(ServerConfig(model_path=str(tiny_hf_dir), return_original_logprob=True).validate())
    engine = state.engine
    engine.start()
    try:
        done, results = threading.Semaphore(0), []

        def on_done(req):
            results.append(req)
            done.release()

        prompts = [[60, 61], [62, 63, 64]]
        for i, prompt in enumerate(prompts):
            engine.submit(GenerateItem(input_ids=prompt, rid=f"o{i}", return_logprob=True,
                                       params=SamplingParams(max_new_tokens=6, temperature=0.5, ignore_eos=True)),
                          on_done)
        for _ in prompts:
            assert done.acquire(timeout=120)
    finally:
        engine.shutdown()
    for req in results:
        expected = ref_logprobs(ref_model, req.item.input_ids, req.output_ids)
        got = [e[0] for e in req.output_logprobs]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-4, rtol=0)


def test_arbitrary_generate_bodies_get_200_or_400_never_500(server):
    """Property: whatever JSON a client sends to /generate, the reply is 200 or 400 (never a 500 or a
    hang) and the server keeps serving."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 600), st.floats(-3, 3, allow_nan=False),
                        st.text(max_size=4))
    values = st.one_of(scalars, st.lists(st.integers(-2, 400), max_size=5),
                       st.lists(st.lists(st.integers(0, 300), max_size=3), max_size=3), st.lists(st.text(max_size=3), max_size=3))
    sp_keys = st.sampled_from(["max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                               "stop_token_ids", "ignore_eos", "n", "sampling_seed", "logit_bias", "no_stop_trim",
                               "repetition_penalty", "frequency_penalty", "bogus"])
    sampling = st.one_of(st.none(), st.dictionaries(sp_keys, values, max_size=4), st.lists(st.dictionaries(sp_keys, values, max_size=2), max_size=2))
    top_keys = st.sampled_from(["input_ids", "text", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
                                "return_text_in_logprobs", "stream", "extra"])
    bodies = st.one_of(st.fixed_dictionaries({"sampling_params": sampling}, optional={k: values for k in [
        "input_ids", "text", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num"]}),
        st.dictionaries(top_keys, values, max_size=4), values)

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(bodies)
    def check(body):
        if isinstance(body, dict) and isinstance(body.get("sampling_params"), dict):
            mnt = body["sampling_params"].get("max_new_tokens")
            if isinstance(mnt, (int, float)) and not isinstance(mnt, bool) and mnt > 8:
                body["sampling_params"]["max_new_tokens"] = 8  # keep each example fast
        status, out = http(server.url + "/generate", body, timeout=60)
        assert status in (200, 400), (body, status, out)

    check()
    assert http(server.url + "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})[0] == 200


def sse_events(url: str, body: dict) -> list:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        lines = [ln.decode().strip() for ln in resp]
    data = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_streaming_is_cumulative_and_ends_like_non_streaming(server):
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    _, plain = http(server.url + "/generate", {"input_ids": [5, 9], "return_logprob": True, "sampling_params": sp})
    events = sse_events(server.url + "/generate", {"input_ids": [5, 9], "return_logprob": True, "stream": True,
                                                   "sampling_params": sp})
    assert len(events) == 6
    for k, ev in enumerate(events):  # cumulative: event k has k + 1 tokens
        assert ev["output_ids"] == plain["output_ids"][: k + 1]
        assert len(ev["meta_info"]["output_token_logprobs"]) == k + 1
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * 5
    assert events[-1]["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    assert events[-1]["output_ids"] == plain["output_ids"]
    batch = sse_events(server.url + "/generate", {"input_ids": [[5, 9], [7]], "stream": True, "sampling_params": sp})
    for i in (0, 1):
        mine = [e for e in batch if e["index"] == i]
        assert mine[-1]["meta_info"]["finish_reason"]["type"] == "length" and len(mine[-1]["output_ids"]) == 6


def test_max_total_tokens_limits_admission_in_process(tiny_hf_dir):
    """Each request reserves prompt + max_new_tokens; with room for one, they run one at a time."""
    import threading

    from megatron_bapo.server.app import build_state
    from megatron_bapo.server.config import ServerConfig
    from megatron_bapo.server.protocol import GenerateItem, SamplingParams

    state = build_state(ServerConfig(model_path=str(tiny_hf_dir), max_total_tokens=100).validate())
    engine = state.engine
    seen_running, done, finished = [], threading.Semaphore(0), []
    engine.start()
    try:
        for i in range(3):
            engine.submit(GenerateItem(input_ids=[10 + i] * 10, rid=f"m{i}",
                                       params=SamplingParams(max_new_tokens=50, ignore_eos=True)),
                          on_done=lambda req: (finished.append(req), done.release()),
                          on_token=lambda req, n: seen_running.append(engine.loads()[0]))
        for _ in range(3):
            assert done.acquire(timeout=120)
    finally:
        engine.shutdown()
    assert max(seen_running) == 1 and all(len(r.output_ids) == 50 for r in finished)
