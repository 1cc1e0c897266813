"""Decrypted content as a person reads it: chat messages as "role: text", never a Python repr."""

from __future__ import annotations

import json
from typing import Any


def _part_text(part: Any) -> str:
    if isinstance(part, dict):
        if part.get("type") == "text" or "text" in part:
            return str(part.get("text", ""))
        return f"[{part.get('type', 'part')}]"
    return str(part)


def message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_part_text(p) for p in content)
    return json.dumps(content, ensure_ascii=False, indent=2)


def as_messages(value: Any) -> list[tuple[str, str]]:
    """(label, text) pairs: one per chat message, or one for a plain prompt or response."""
    if isinstance(value, str):
        return [("", value)]
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m
                                                  for m in value):
        return [(str(m["role"]), message_text(m.get("content"))) for m in value]
    if isinstance(value, list) and all(isinstance(p, str) for p in value):
        return [(f"prompt {i + 1}" if len(value) > 1 else "", p) for i, p in enumerate(value)]
    if value is None:
        return []
    return [("", json.dumps(value, ensure_ascii=False, indent=2))]
