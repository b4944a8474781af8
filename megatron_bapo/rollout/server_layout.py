"""What a server's parallel layout means for the distributed weight group (spec section 10).

SGLang (0.5.23, `model_runner_components/weight_updater.py`) joins the group with one rank per
scheduler process, numbered `rank_offset + tp_rank`: the tensor-parallel rank only. A server with
pipeline stages (`pp_size > 1`) or data-parallel replicas without DP attention (`dp_size > 1`, each
replica its own TP group) has several processes with the same `tp_rank`, so they would claim the
same ranks and the rendezvous would wait until `sync.group_timeout_s`. With DP attention the
replicas share one TP group of `tp_size` ranks, which is what the group gets.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from megatron_bapo.config_io import ConfigError


def weight_group_ranks(infos: Mapping[str, Optional[dict]], urls: Sequence[str]) -> list[int]:
    """The ranks each server in `urls` brings to the weight group (its `tp_size`), from its
    `/server_info`; ConfigError, one line naming the server, its sizes and the fix, for a layout whose
    ranks would collide (pipeline stages, or data-parallel replicas without DP attention)."""
    ranks = []
    for url in urls:
        info = infos.get(url) or {}
        tp, pp, dp = (int(info.get(k) or 1) for k in ("tp_size", "pp_size", "dp_size"))
        dp_attention = bool(info.get("enable_dp_attention"))
        colliding = [f"{pp} pipeline stages"] if pp > 1 else []
        if dp > 1 and not dp_attention:
            colliding.append(f"{dp} data-parallel replicas without DP attention")
        if colliding:
            raise ConfigError(
                f"server {url} runs tp_size={tp} pp_size={pp} dp_size={dp} (enable_dp_attention={dp_attention}): SGLang "
                f"numbers weight-group ranks rank_offset + tp_rank, so its {' and '.join(colliding)} would join with "
                f"the same ranks and the distributed sync would hang until sync.group_timeout_s; launch one server per "
                f"replica with --pp-size 1 and --dp-size 1 (or --enable-dp-attention) behind the router, or use "
                f"sync.method=disk")
        ranks.append(tp)
    return ranks
