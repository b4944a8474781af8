"""Prompt datasets on small jsonl/parquet files written by the tests, tokenized with the tiny
char-level tokenizer (chat template included)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_bapo.data import DatasetConfig, PromptDataset
from megatron_bapo.tiny.tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def write_jsonl(path, rows, extra_lines=()):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


GOOD = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "source": "add"} for i in range(10)]


def test_jsonl_text_prompts_chat_template_and_raw(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", GOOD)
    ds = PromptDataset(DatasetConfig(path=path, shuffle=False), tok)
    p = ds.next_batch(1)[0]
    expected = tok.apply_chat_template([{"role": "user", "content": "0+0="}], tokenize=False, add_generation_prompt=True)
    assert tok.decode(p.prompt_ids) == expected
    assert (p.answer, p.index, p.metadata) == ("0", 0, {"source": "add"})
    raw = PromptDataset(DatasetConfig(path=path, shuffle=False, apply_chat_template=False), tok)
    assert tok.decode(raw.next_batch(1)[0].prompt_ids) == "0+0="
    sys_ds = PromptDataset(DatasetConfig(path=path, shuffle=False, system_prompt="Add."), tok)
    assert tok.decode(sys_ds.next_batch(1)[0].prompt_ids).startswith("<|im_start|>system\nAdd.<|im_end|>")


def test_parquet_with_chat_messages(tmp_path, tok):
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i}*2="}],
             "answer": i * 2, "level": i % 3} for i in range(6)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    ds = PromptDataset(DatasetConfig(path=str(path), shuffle=False), tok)
    assert len(ds) == 6 and ds.num_bad_rows == 0
    p = ds.next_batch(2)[1]
    text = tok.decode(p.prompt_ids)
    assert text == tok.apply_chat_template(rows[1]["prompt"], tokenize=False, add_generation_prompt=True)
    assert p.answer == "2" and p.metadata == {"level": 1}  # answers become strings


def test_bad_rows_and_long_prompts_are_skipped_and_counted(tmp_path, tok):
    bad = [{"prompt": "", "answer": "1"}, {"prompt": "1+1="}, {"prompt": "2+2=", "answer": "  "},
           {"prompt": [{"role": "user"}], "answer": "3"}, {"prompt": 17, "answer": "3"}, [1, 2],
           {"prompt": "x" * 500, "answer": "long"}]
    path = write_jsonl(tmp_path / "d.jsonl", GOOD[:3] + bad, extra_lines=["{not json", ""])
    ds = PromptDataset(DatasetConfig(path=path, max_prompt_tokens=100, shuffle=False), tok)
    assert len(ds) == 3
    assert ds.num_rows == 11 and ds.num_bad_rows == 7 and ds.num_too_long == 1
    m = ds.metrics()
    assert m["data/num_bad_rows"] == 7 and m["data/num_too_long"] == 1 and m["data/num_prompts"] == 3
    assert [p.index for p in ds.next_batch(3)] == [0, 1, 2]
    only_bad = write_jsonl(tmp_path / "bad.jsonl", bad)
    with pytest.raises(ValueError, match="no usable prompt"):
        PromptDataset(DatasetConfig(path=only_bad, max_prompt_tokens=100), tok)


def test_undecodable_bytes_are_one_bad_row_not_a_dead_run(tmp_path, tok):
    """A stray non-UTF-8 byte (a Latin-1 export, a truncated multibyte character) used to raise
    UnicodeDecodeError at a buffer offset and kill the run; now its line is skipped and counted."""
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(r).encode() for r in GOOD[:4]]
    lines.insert(2, b'{"prompt": "caf\xe9 1+1=", "answer": "2"}')  # Latin-1 e-acute: invalid UTF-8
    lines.append(b'{"prompt": "\xf0\x9f", "answer": "1"}')  # a truncated 4-byte sequence
    path.write_bytes(b"\n".join(lines) + b"\n")
    ds = PromptDataset(DatasetConfig(path=str(path), shuffle=False, apply_chat_template=False), tok)
    assert len(ds) == 4 and ds.num_rows == 6 and ds.num_bad_rows == 2
    assert [p.index for p in ds.next_batch(4)] == [0, 1, 3, 4]  # row indices keep the file's line order


def test_order_is_seeded_per_epoch_and_resumes_exactly(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", GOOD)
    cfg = DatasetConfig(path=path, seed=3)
    ds = PromptDataset(cfg, tok)
    first_epoch = [p.index for p in ds.next_batch(10)]
    assert sorted(first_epoch) == list(range(10)) and first_epoch != list(range(10))
    second_epoch = [p.index for p in ds.next_batch(10)]
    assert sorted(second_epoch) == list(range(10)) and second_epoch != first_epoch

    a = PromptDataset(cfg, tok)
    a.next_batch(7)
    state = json.loads(json.dumps(a.state_dict()))
    expected = [p.index for p in a.next_batch(9)]  # crosses into epoch 1
    b = PromptDataset(cfg, tok)
    b.load_state_dict(state)
    assert [p.index for p in b.next_batch(9)] == expected
    assert [p.index for p in PromptDataset(cfg, tok).next_batch(20)] == first_epoch + second_epoch

    smaller = PromptDataset(DatasetConfig(path=path, seed=3, max_rows=5), tok)
    with pytest.raises(ValueError, match="usable prompts"):
        smaller.load_state_dict(state)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="DatasetConfig.path"):
        DatasetConfig(path="")
    with pytest.raises(ValueError, match="DatasetConfig.path"):
        DatasetConfig(path="data.csv")
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        DatasetConfig(path="d.jsonl", max_prompt_tokens=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        PromptDataset(DatasetConfig(path="/nonexistent/d.jsonl"), None)
