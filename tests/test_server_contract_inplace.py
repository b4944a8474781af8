"""The in_place pause, against live SGLang and the built-in server (the rest of the contract:
`tests/test_server_contract.py`).

`sync.pause_mode=in_place` needs servers without a radix cache (`required_server_flags`: an update
cannot flush KV the paused requests hold, so no cache may keep KV of old weights for later requests):
this module's servers are launched as the trainer launches them for that mode.
"""

from __future__ import annotations

import pytest
import torch

from contract_helpers import ENGINES, Served
from megatron_bapo.rollout.errors import RolloutError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("model_b"), seed=1)


@pytest.fixture(scope="module", params=ENGINES)
def served(request, tiny_hf_dir, model_b, tmp_path_factory):
    server = Served(request.param, tiny_hf_dir, model_b, tmp_path_factory.mktemp(f"logs_{request.param}"),
                    pause_mode="in_place")
    yield server
    server.close()


def test_the_pool_starts_the_server_without_radix_cache(served):
    info = served.client.run(served.client.aget_server_info())[served.url]
    assert info["disable_radix_cache"] is True


def test_the_in_place_pause_keeps_requests_and_their_kv_across_an_update(served):
    """The trainer's disk sync under `sync.pause_mode=in_place`: paused in place, requests keep their
    KV, so a flush is refused (and an update that asks for one fails); the update without a flush
    lands, and after continue each request finishes with every token labelled with the version that
    produced it; the tokens before the update are the old weights'."""
    start, new = served.version, served.version + 1
    requests = served.long_requests(2, max_new_tokens=200)
    with served.pool.update(new) as session:  # pauses in place; continues on exit
        status, text = served.http("POST", "/flush_cache")
        assert status == 400, text
        with pytest.raises(RolloutError, match="update_weights_from_disk failed"):
            served.client.update_weights_from_disk(str(served.model_b), new, flush_cache=True)
        session.load_from_disk(served.model_b, new)
    assert served.version == new
    for prompt, future in requests:
        r = future.result(120)
        assert r.finish_type == "length" and len(r.output_ids) == 200
        split = r.versions.index(new)
        assert split > 0 and r.versions == [start] * split + [new] * (200 - split)
        before = served.ref_logprobs(prompt, r.output_ids, path=served.model_a)[:split]
        torch.testing.assert_close(torch.tensor(r.logprobs[:split], dtype=torch.float64), before, atol=1e-4, rtol=0)
    served.client.flush_cache()  # idle again: the flush goes through
