"""How the checkpoint's JSON files are written (indented, UTF-8, a final newline)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping


def write_json(path: Path, obj: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
