"""The tiny checkpoint and char-level tokenizer: offline loading by transformers' Auto classes,
round trips, special-token ids, chat template, determinism and overrides."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint
from megatron_bapo.tiny.tokenizer import CHARACTERS, build_tiny_tokenizer

ROUND_TRIP_STRINGS = [
    "",
    "47+38=",
    "Hello, world!\n\tindented  double  spaces  ",
    "".join(CHARACTERS),
    "  leading and trailing  ",
    "<|im_end|>",  # a special token written as text round-trips as that token
    "{\\boxed{12}} ~`|^",
    "h\u00e9llo \u4e2d",  # non-ASCII: several byte tokens per character, still lossless
]


@pytest.mark.parametrize("text", ROUND_TRIP_STRINGS)
def test_tokenizer_round_trip(text):
    tok = build_tiny_tokenizer()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    if "<|" not in text and text.isascii():
        assert len(ids) == len(text)  # one token per character, no BOS added


def test_tokenizer_layout():
    tok = build_tiny_tokenizer()
    assert len(tok) == 320 and len(tok) % 64 == 0
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [2, 3]
    assert tok.encode("0123456789") == list(range(22, 32))
    assert tok.encode("".join(CHARACTERS)) == list(range(4, 4 + len(CHARACTERS)))
    assert len(build_tiny_tokenizer(pad_to_multiple_of=1)) == 4 + 256 + 4  # specials, bytes, tool-call markup


def test_tool_call_markup_is_one_token_each_and_survives_decoding(tiny_hf_dir):
    """The Hermes/Qwen3 markup tokenizes the same wherever it appears (added tokens, ids 260-263), also
    through the saved checkpoint's tokenizer, and is not special: skipping special tokens keeps it."""
    from megatron_bapo.tiny.tokenizer import TOOL_TOKENS

    for tok in (build_tiny_tokenizer(), AutoTokenizer.from_pretrained(tiny_hf_dir)):
        assert tok.convert_tokens_to_ids(list(TOOL_TOKENS)) == [260, 261, 262, 263]
        text = '7<tool_call>{"name":"c"}</tool_call>x<tool_response>42</tool_response>42'
        ids = tok.encode(text)
        assert [i for i in ids if i >= 260] == [260, 261, 262, 263]
        assert tok.encode("a" + text[1:])[1:] == ids[1:]  # what precedes the markup does not change it
        assert tok.decode(ids + [1], skip_special_tokens=True) == text


def test_checkpoint_loads_with_auto_classes(tiny_hf_dir):
    tok = AutoTokenizer.from_pretrained(tiny_hf_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_hf_dir)
    config = model.config
    assert config.architectures == ["Qwen2ForCausalLM"]
    assert config.vocab_size == len(tok) == 320
    assert config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert config.num_key_value_heads < config.num_attention_heads  # GQA
    assert model.dtype == torch.float32
    assert config.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
    assert config.pad_token_id == tok.pad_token_id == model.generation_config.pad_token_id
    assert (tiny_hf_dir / "model.safetensors").exists()
    text = "Hello, world!\n\t 12+34=  "
    assert tok.encode(text) == build_tiny_tokenizer().encode(text)  # Qwen2Tokenizer rebuilds it the same
    assert tok.decode(tok.encode(text)) == text

    chat = tok.apply_chat_template([{"role": "user", "content": "12+34="}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"

    prompt = torch.tensor([tok.encode("12+34=")])
    out = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 1 and 6 < out.shape[1] <= 10
    assert int(out.max()) < config.vocab_size


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    a = AutoModelForCausalLM.from_pretrained(make_tiny_hf_checkpoint(tmp_path / "a", seed=3))
    b = AutoModelForCausalLM.from_pretrained(make_tiny_hf_checkpoint(tmp_path / "b", seed=3))
    c = AutoModelForCausalLM.from_pretrained(make_tiny_hf_checkpoint(tmp_path / "c", seed=4))
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_overrides_llama_untied(tmp_path):
    path = make_tiny_hf_checkpoint(
        tmp_path / "llama", architecture="llama", hidden_size=128, num_hidden_layers=3, tie_word_embeddings=False,
    )
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.tie_word_embeddings) == (128, 3, False)
    saved = json.loads((path / "config.json").read_text())
    assert saved["vocab_size"] == len(AutoTokenizer.from_pretrained(path))
    model = AutoModelForCausalLM.from_pretrained(path)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_bad_overrides_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="architecture"):
        make_tiny_hf_checkpoint(tmp_path / "x", architecture="gpt2")
    with pytest.raises(ValueError, match="vocab_size"):
        make_tiny_hf_checkpoint(tmp_path / "y", vocab_size=10)
