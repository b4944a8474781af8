"""Batch building and rollout config validation (no server)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_bapo.rollout import (PartialRolloutConfig, Prompt, RolloutClientConfig, RolloutGroup, Sample,
                                   SampleState, SamplingConfig, build_batch, parse_generate_reply, parse_version)
from megatron_bapo.rollout.errors import ProtocolError


def sample(prompt, response, versions=None):
    lps = [-0.1 * (i + 1) for i in range(len(response))]
    return Sample(prompt_ids=prompt, response_ids=response, response_logprobs=lps,
                  response_versions=versions or [5] * len(response), state=SampleState.COMPLETED)


def test_batch_is_aligned_to_the_token_and_right_padded():
    s = [sample([10, 11, 12], [20, 21]), sample([13], [22, 23, 24, 25], [4, 4, 5, 5])]
    b = build_batch(s, pad_token_id=0, advantages=[1.5, -0.5], rewards=[1.0, 0.0], pad_to_multiple_of=4)
    assert b["input_ids"].tolist() == [[10, 11, 12, 20, 21, 0, 0, 0], [13, 22, 23, 24, 25, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    assert b["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 0, 0, 0]]
    assert torch.allclose(b["behavior_logprobs"][0], torch.tensor([0, 0, 0, -0.1, -0.2, 0, 0, 0]))
    assert torch.allclose(b["behavior_logprobs"][1, 1:5], torch.tensor([-0.1, -0.2, -0.3, -0.4]))
    assert b["versions"].tolist() == [[-1, -1, -1, 5, 5, -1, -1, -1], [-1, 4, 4, 5, 5, -1, -1, -1]]
    assert b["advantages"].tolist() == [[0, 0, 0, 1.5, 1.5, 0, 0, 0], [0, -0.5, -0.5, -0.5, -0.5, 0, 0, 0]]
    assert b["prompt_lengths"].tolist() == [3, 1] and b["response_lengths"].tolist() == [2, 4]
    assert b["rewards"].tolist() == [1.0, 0.0]
    assert b["input_ids"].dtype == torch.long and b["behavior_logprobs"].dtype == torch.float32
    with pytest.raises(ValueError, match="one per sample"):
        build_batch(s, advantages=[1.0])
    broken = sample([1], [2, 3])
    broken.response_versions = [1]
    with pytest.raises(ValueError, match="versions"):
        build_batch([broken])


def test_group_round_trips_through_json():
    g = RolloutGroup(group_id="ab" * 16, prompt=Prompt([1, 2], "3", 7, {"k": [1]}),
                     samples=[sample([1, 2], [3]), Sample(prompt_ids=[1, 2], state=SampleState.ABORTED)],
                     start_version=2)
    again = RolloutGroup.from_dict(json.loads(json.dumps(g.to_dict())))
    assert again == g and not again.finished


def test_reply_parsing_follows_the_spec():
    body = {"text": "x", "output_ids": [5, 1], "meta_info": {
        "finish_reason": {"type": "stop", "matched": 1}, "weight_version": "12",
        "output_token_logprobs": [[-0.5, 5, None], [-0.25, 1, None]]}}
    r = parse_generate_reply(body, rid="r", url="u")
    assert (r.output_ids, r.logprobs, r.versions, r.finish_type) == ([5, 1], [-0.5, -0.25], [12, 12], "stop")
    spans = {**body["meta_info"], "weight_versions": [{"version": "3", "start": 0, "end": 1},
                                                      {"version": "4", "start": 1, "end": 2}]}
    assert parse_generate_reply({**body, "meta_info": spans}, rid="r", url="u").versions == [3, 4]
    queued = {"meta_info": {"finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                            "weight_version": "default"}}
    r = parse_generate_reply(queued, rid="r", url="u")
    assert r.output_ids == [] and r.finish_type == "abort"
    with pytest.raises(ProtocolError, match="without meta_info.output_token_logprobs"):
        parse_generate_reply({"output_ids": [5], "meta_info": {"finish_reason": {"type": "length"}}}, rid="r", url="u")
    with pytest.raises(ProtocolError, match="finish_reason"):
        parse_generate_reply({"meta_info": {"finish_reason": {"type": "weird"}}}, rid="r", url="u")
    assert parse_version("7") == 7 and parse_version("default") is None


@pytest.mark.parametrize("change, field", [
    (lambda m: m["output_token_logprobs"][1].__setitem__(0, 5.0), r"output_token_logprobs\[1\] log-prob 5.0"),
    (lambda m: m["output_token_logprobs"][0].__setitem__(0, float("nan")), r"output_token_logprobs\[0\] log-prob nan"),
    (lambda m: m["output_token_logprobs"][0].__setitem__(0, float("inf")), r"output_token_logprobs\[0\] log-prob inf"),
    (lambda m: m["output_token_logprobs"][0].__setitem__(0, "x"), r"output_token_logprobs\[0\] log-prob 'x' is not"),
    (lambda m: m["output_token_logprobs"].extend([[-1.0, 7, None]] * 3), r"5 tokens, more than the max_new_tokens=4"),
    (lambda m: m["output_token_logprobs"][1].__setitem__(1, 64), r"token id 64 is outside the vocabulary \[0, 64\)"),
    (lambda m: m["output_token_logprobs"][1].__setitem__(1, -1), r"token id -1 is outside the vocabulary"),
    (lambda m: m.__setitem__("weight_version", "13"), r"weight_version 13 is newer than the newest version .* \(12\)"),
    (lambda m: m.__setitem__("weight_versions", [{"version": "14", "start": 1, "end": 2}]), r"weight_version 14"),
])
def test_impossible_replies_are_refused_naming_the_server_and_field(change, field):
    """What a reply must satisfy before it can become a sample: log-probs <= 0 (or -inf), no more tokens
    than asked, ids inside the vocabulary, no version above the newest published one."""
    meta = {"finish_reason": {"type": "length"}, "weight_version": "12",
            "output_token_logprobs": [[-0.5, 5, None], [-0.25, 9, None]]}
    limits = {"max_new_tokens": 4, "vocab_size": 64, "max_version": 12}
    good = parse_generate_reply({"meta_info": meta}, rid="r", url="http://s:1", **limits)
    assert good.output_ids == [5, 9] and good.versions == [12, 12]
    change(meta)
    with pytest.raises(ProtocolError, match=field) as err:
        parse_generate_reply({"meta_info": meta}, rid="r", url="http://s:1", **limits)
    assert str(err.value).startswith("http://s:1/generate reply")


def test_minus_infinity_and_float_noise_are_log_probs():
    meta = {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[float("-inf"), 5, None], [1e-6, 1, None]]}
    r = parse_generate_reply({"meta_info": meta}, rid="r", url="u", max_new_tokens=2, vocab_size=64, max_version=0)
    assert r.logprobs == [float("-inf"), 1e-6] and r.versions == [None, None]


def test_configs_validate_and_name_the_field():
    from megatron_bapo.rollout import RolloutClient

    with pytest.raises(ValueError, match="urls"):
        RolloutClient(RolloutClientConfig())  # a config may wait for built-in servers; a client may not
    with pytest.raises(ValueError, match="http://"):
        RolloutClientConfig(urls=["localhost:3000"])
    with pytest.raises(ValueError, match="max_concurrency"):
        RolloutClientConfig(urls=["http://a:1"], max_concurrency=0)
    assert RolloutClientConfig(router_url="http://r:1/").router_url == "http://r:1"
    with pytest.raises(ValueError, match="segment_tokens"):
        PartialRolloutConfig(segment_tokens=0)
    with pytest.raises(ValueError, match="max_staleness"):
        PartialRolloutConfig(max_staleness=-1)
    with pytest.raises(ValueError, match="unknown sampling key"):
        SamplingConfig(extra={"n": 4})
    with pytest.raises(ValueError, match="top_k"):
        SamplingConfig(top_k=0)
    assert PartialRolloutConfig(max_response_tokens=100, segment_tokens=300).segment_budget == 100
    params = SamplingConfig(temperature=0.0, stop_token_ids=[3]).to_params()
    assert params["temperature"] == 0.0 and params["stop_token_ids"] == [3] and params["no_stop_trim"] is True


def test_configs_load_from_yaml_style_dicts():
    from megatron_bapo.config_io import ConfigError, from_dict

    cfg = from_dict(PartialRolloutConfig, {"group_size": 4, "segment_tokens": 64,
                                           "sampling": {"temperature": 0.7, "extra": {"min_p": 0.1}}})
    assert cfg.sampling.temperature == 0.7 and cfg.sampling.to_params()["min_p"] == 0.1
    with pytest.raises(ConfigError, match="sampling"):
        from_dict(PartialRolloutConfig, {"sampling": {"temprature": 1.0}})
