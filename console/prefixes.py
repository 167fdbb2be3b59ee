"""How a prefix reads for a person: its words, whose it is, and its hash only as a last resort (pure).

The exporter names a branch by the text its first tokens detokenize to (``text``, when prefix
text is on), else by those tokens (``token_ids``), and says which tenant (cache salt) and LoRA
adapter stored it. Lists and headlines show the words shortened to a glance on one line; the
full text stays at hand (a hover, an expander), never cut at a block's worth of characters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

GLANCE_CHARS = 60


def short(text: str, limit: int = GLANCE_CHARS) -> str:
    """One line of at most ``limit`` characters, cut at a word where one is near, with an ellipsis."""
    flat = " ".join(text.split())
    if len(flat) <= limit:
        return flat
    cut = flat[: limit - 1]
    space = cut.rfind(" ")
    if space >= limit * 2 // 3:
        cut = cut[:space]
    return cut.rstrip(" ,.;:") + "…"


def words(text: str | None, token_ids: Sequence[int] | None, limit: int | None = GLANCE_CHARS) -> str:
    """``“You are a support agent for…”``, else ``tokens 12 54 …``, else "" (nothing to name it by)."""
    if text:
        return f"“{short(text, limit) if limit else ' '.join(text.split())}”"
    if token_ids:
        shown = " ".join(str(t) for t in token_ids[:8])
        return f"tokens {shown}{' …' if len(token_ids) > 8 else ''}"
    return ""


def owner(tenant: str | None, adapter: str | None) -> str:
    """``tenant acme · adapter billing-lora``, or "" when the branch names neither."""
    parts = ([f"tenant {tenant}"] if tenant else []) + ([f"adapter {adapter}"] if adapter else [])
    return " · ".join(parts)


def of(branch: Mapping, limit: int | None = GLANCE_CHARS) -> str:
    """A branch of the API (hot branch, tree node, lost branch, culprit) as words and owner."""
    text = branch.get("text") if isinstance(branch.get("text"), str) else None
    tokens = branch.get("token_ids") if isinstance(branch.get("token_ids"), list) else None
    name = words(text, tokens, limit)
    who = owner(_str(branch.get("tenant")), _str(branch.get("adapter")))
    return f"{name} ({who})" if name and who else name or (f"({who})" if who else "")


def _str(v: object) -> str | None:
    return v if isinstance(v, str) and v else None
