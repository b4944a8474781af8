"""Character-level tokenizer for the tiny default, in the byte-level BPE format Qwen2 uses.

Why char-level: the synthetic task is arithmetic over digits, so one token per character keeps the
vocabulary tiny (a 64-wide embedding is then a real share of the model, not a 150k-row table) and makes
every answer digit its own decision for the policy.

Why byte-level BPE with no merges (rather than a WordLevel model): transformers 5 loads any
`model_type == "qwen2"` directory with `Qwen2Tokenizer`, which rebuilds the tokenizer from `vocab` +
`merges` with Qwen2's own normalizer/pre-tokenizer/decoder and ignores ours. Using exactly that
pipeline (NFC, Qwen2 split regex, ByteLevel) with an empty merge list gives one token per byte and
loads identically through `Qwen2Tokenizer`, `TokenizersBackend` and SGLang. Every byte has a token, so
`decode(encode(s)) == s` for any NFC-normalised text (one token per character for ASCII).

Layout (ids are stable, tests and docs rely on them):
- 0 `<|pad|>`, 1 `<|endoftext|>` (EOS), 2 `<|im_start|>`, 3 `<|im_end|>`;
- 4.. "\\t", "\\n" and the 95 printable ASCII characters (space .. "~"), so digit d is id 4 + 2 + 16 + d;
- then the other 159 byte values (non-ASCII text, control characters);
- then the tool-call markup of Qwen3/Hermes (`TOOL_TOKENS`: 260 `<tool_call>`, 261 `</tool_call>`,
  262 `<tool_response>`, 263 `</tool_response>`), one token each, as Qwen3's vocabulary has them, so
  the markup tokenizes the same way wherever it appears and a model turn can stop on `</tool_call>`
  (`rollout.agent`, docs/rollout.md). Like Qwen3's they are added tokens that are not "special":
  `decode(..., skip_special_tokens=True)` keeps them, so a reward sees the whole exchange;
- then `<|reserved_K|>` specials padding the vocabulary to a multiple of `pad_to_multiple_of`, so
  `len(tokenizer) == config.vocab_size` (320 by default).
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
TOOL_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Hermes/Qwen3 tool-call markup, one (non-special) added token each."""

CHARACTERS: tuple[str, ...] = ("\t", "\n") + tuple(chr(c) for c in range(0x20, 0x7F))
"""The characters that come first in the vocabulary: tab, newline and printable ASCII."""

QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""Qwen2's pre-tokenisation regex (as in transformers' Qwen2Tokenizer); with no merges it only decides
where BPE may merge, so it does not change the one-token-per-byte result."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML-style template (as Qwen2 uses) over the tiny vocabulary; `add_generation_prompt` opens the
assistant turn."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map used by the ByteLevel pre-tokenizer."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
    keep += list(range(ord("\xae"), ord("\xff") + 1))
    mapping = {b: chr(b) for b in keep}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def tiny_vocab(pad_to_multiple_of: int = 64) -> dict[str, int]:
    """Token (in ByteLevel alphabet) -> id for the layout in the module docstring."""
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    byte_chars = _bytes_to_unicode()
    first = [ord(c) for c in CHARACTERS]
    byte_order = first + [b for b in range(256) if b not in set(first)]
    tokens = list(SPECIAL_TOKENS) + [byte_chars[b] for b in byte_order] + list(TOOL_TOKENS)
    tokens += [f"<|reserved_{k}|>" for k in range(-len(tokens) % pad_to_multiple_of)]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tiny_tokenizer(pad_to_multiple_of: int = 64) -> PreTrainedTokenizerFast:
    """A char-level fast tokenizer with EOS/pad set and a chat template.

    No BOS is added (Qwen2 convention); the caller appends EOS where a sequence ends. Special tokens
    written as text (e.g. "<|im_end|>") encode to their single id.
    """
    vocab = tiny_vocab(pad_to_multiple_of)
    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=[], dropout=None, unk_token=None, continuing_subword_prefix="",
                   end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    )
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(tok, special=True) for tok in vocab if tok.startswith("<|")])
    backend.add_tokens([AddedToken(tok, special=False, normalized=False) for tok in TOOL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=None,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
