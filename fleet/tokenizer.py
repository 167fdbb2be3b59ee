"""A deterministic, prefix-preserving fake tokenizer.

Byte-level: one token per UTF-8 byte (ids 0–255, offset so that 0 stays unused). Because it
is byte-level, ``encode(a + b) == encode(a) + encode(b)``, so a prompt that extends another
extends its tokens too, which is what prefix caching needs. Chat messages are rendered with
role markers the way a chat template would, so a follow-up turn (the previous messages plus
the assistant's answer plus a new user message) extends the previous turn's tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_OFFSET = 1
MAX_MODEL_LEN = 131072
# byte -> byte + 1 in one C-level pass; 0xFF never occurs in UTF-8, so nothing needs id 256
_SHIFT = bytes(range(_OFFSET, 256)) + b"\xff"


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8").translate(_SHIFT))


def decode(token_ids: Sequence[int]) -> str:
    return bytes(t - _OFFSET for t in token_ids if _OFFSET <= t < 256 + _OFFSET).decode("utf-8", "replace")


class ChatFormatError(ValueError):
    pass


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts: keep the text parts
        parts = []
        for part in content:
            if not isinstance(part, Mapping):
                raise ChatFormatError("message content parts must be objects")
            if part.get("type") == "text":
                if not isinstance(part.get("text"), str):
                    raise ChatFormatError("a text content part needs a string 'text'")
                parts.append(part["text"])
        return "".join(parts)
    raise ChatFormatError("message content must be a string or a list of content parts")


def render_chat(messages: Any, add_generation_prompt: bool = True) -> str:
    """Render chat messages like a ChatML template; raises ChatFormatError on bad shapes."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatFormatError(f"messages[{i}] must be an object")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ChatFormatError(f"messages[{i}].role must be a non-empty string")
        out.append(f"<|im_start|>{role}\n{_content_text(m.get('content'))}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def encode_chat(messages: Any, add_generation_prompt: bool = True) -> list[int]:
    return encode(render_chat(messages, add_generation_prompt))
