"""How a model writes a tool call and how a tool's result is written back: parsing and rendering.

The default is the Hermes format Qwen2.5/Qwen3 are trained on (SGLang's `qwen25` tool parser):

    <tool_call>{"name": "calculator", "arguments": {"expression": "482*37"}}</tool_call>

One model turn may hold several such blocks (parallel calls: run concurrently, results in order). Only
complete blocks count; text outside them is ignored; a block whose body is not a JSON object with a
string "name" (and an "arguments" object, or a JSON string holding one) is a malformed call: the
model gets an error message as its result, and the call counts as an error. A turn without a
complete block is the final answer.

Results go back as exact token ids: the text `response_prefix + response_template(result) joined by
response_separator + response_suffix` is tokenized on its own and appended to the ids sampled so
far; nothing generated is decoded and tokenized again (so the trained tokens are the sampled ones).
Start the prefix (or template) with an added token such as `<tool_response>` or `<|im_end|>`, so no
tokenizer merge could have crossed the boundary had the conversation been tokenized as one text.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Optional, Sequence



@dataclasses.dataclass
class ToolCallFormat:
    """`rollout.agent.format`: the call markup and the result wrapping (defaults: raw Hermes, as the
    tiny tool task uses; docs/rollout.md shows the values for Qwen3's chat template)."""

    parser: str = "hermes"
    """Call syntax: "hermes" (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`)."""
    call_start: str = "<tool_call>"
    call_end: str = "</tool_call>"
    stop_at_call_end: bool = True
    """End the model's turn right after `call_end` (a stop token id when it is one token, else a stop
    string): the model cannot invent the tool's answer. False: the turn ends at EOS (or the model's
    own stop tokens, e.g. Qwen3's `<|im_end|>`) and every complete call in it is run."""
    response_prefix: str = ""
    """Text before the results (Qwen3 chat, stopping at the call: "<|im_end|>\\n<|im_start|>user\\n")."""
    response_template: str = "<tool_response>{result}</tool_response>"
    """One result; `{result}` is replaced by the tool's text (no other braces are interpreted)."""
    response_separator: str = ""
    """Between the results of several calls of one turn."""
    response_suffix: str = ""
    """Text after the results (Qwen3 chat: "<|im_end|>\\n<|im_start|>assistant\\n")."""

    def __post_init__(self) -> None:
        if self.parser not in PARSERS:
            raise ValueError(f"rollout.agent.format.parser must be one of {list(PARSERS)}, got {self.parser!r}")
        if not self.call_start or not self.call_end:
            raise ValueError("rollout.agent.format.call_start and call_end must be non-empty")
        if "{result}" not in self.response_template:
            raise ValueError(f"rollout.agent.format.response_template must contain {{result}}, got "
                             f"{self.response_template!r}")


@dataclasses.dataclass
class ToolCall:
    """One parsed call: `name` and `arguments`, or `error` (malformed; `name` may still be known)."""

    name: Optional[str]
    arguments: Optional[dict] = None
    error: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments, "error": self.error}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ToolCall":
        return cls(name=d.get("name"), arguments=d.get("arguments"), error=d.get("error"))


def parse_tool_calls(text: str, fmt: ToolCallFormat) -> list[ToolCall]:
    """The calls in one model turn's text, in order (empty: the turn is a final answer), by the
    format's parser (`PARSERS[fmt.parser]`)."""
    return PARSERS[fmt.parser](text, fmt)


def parse_hermes(text: str, fmt: ToolCallFormat) -> list[ToolCall]:
    """Hermes: a JSON object `{"name", "arguments"}` in each complete `call_start ... call_end` block."""
    pattern = re.escape(fmt.call_start) + r"(.*?)" + re.escape(fmt.call_end)
    return [_parse_hermes_body(m.group(1)) for m in re.finditer(pattern, text, flags=re.DOTALL)]


PARSERS: dict[str, Callable[[str, "ToolCallFormat"], list[ToolCall]]] = {"hermes": parse_hermes}
"""Call syntaxes by name (`rollout.agent.format.parser`). Another syntax (e.g. SGLang's `pythonic`
or `llama3`): a function `(turn_text, fmt) -> [ToolCall]` registered here."""


def _parse_hermes_body(body: str) -> ToolCall:
    try:
        obj = json.loads(body.strip())
    except ValueError as exc:
        return ToolCall(None, error=f"the tool call is not valid JSON ({exc})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall(None, error='the tool call must be a JSON object with a "name" string and "arguments"')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return ToolCall(obj["name"], error=f'the "arguments" of {obj["name"]!r} are not valid JSON')
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error=f'the "arguments" of {obj["name"]!r} must be a JSON object')
    return ToolCall(obj["name"], args)


def render_results(results: Sequence[str], fmt: ToolCallFormat) -> str:
    """The text appended after a turn's calls: prefix, each result in the template, suffix."""
    body = fmt.response_separator.join(fmt.response_template.replace("{result}", r) for r in results)
    return fmt.response_prefix + body + fmt.response_suffix


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` alone (no BOS/EOS added)."""
    return [int(x) for x in tokenizer(text, add_special_tokens=False)["input_ids"]]


def stop_params(tokenizer: Any, fmt: ToolCallFormat) -> dict[str, list]:
    """Sampling additions that end a turn at `call_end` (`stop_at_call_end`): its token id when it is
    one token, else the string."""
    if not fmt.stop_at_call_end:
        return {}
    ids = encode_text(tokenizer, fmt.call_end)
    return {"stop_token_ids": ids} if len(ids) == 1 else {"stop": [fmt.call_end]}
