"""Small text helpers shared by the streaming parsers."""
from __future__ import annotations

import json
from typing import Iterable


def partial_tag_len(buf: str, tags: Iterable[str]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of one of `tags` (0 if none): the text a
    stream must hold back because a tag may be forming."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), best, -1):
            if buf.endswith(tag[:n]):
                best = n
                break
    return best


def arguments_json(obj: dict, keys: tuple[str, ...] = ("arguments", "parameters")) -> str | None:
    """A call object's arguments (under the first of `keys` present; JSON text or an object; missing/null = {})
    as JSON text, or None when they are not an object."""
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if args is None:
        args = {}
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None
