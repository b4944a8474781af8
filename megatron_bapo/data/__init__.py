"""Prompt datasets (jsonl / parquet) for RL.

    from megatron_bapo.data import DatasetConfig, PromptDataset
    ds = PromptDataset(DatasetConfig(path="train.jsonl", max_prompt_tokens=512), tokenizer)
    prompts = ds.next_batch(32)            # list[megatron_bapo.rollout.Prompt] (prompt_ids, answer, index, metadata)
    ds.state_dict() / ds.load_state_dict(d) # {epoch, position}: resumable seeded order
    ds.metrics()                            # data/num_bad_rows, data/num_too_long, ...
"""

from megatron_bapo.data.config import DatasetConfig
from megatron_bapo.data.dataset import PromptDataset, read_rows
from megatron_bapo.rollout.types import Prompt

__all__ = ["DatasetConfig", "Prompt", "PromptDataset", "read_rows"]
