"""Well-known model shapes (configs/models/*.json, HF config.json files) for benchmarks and plans without
a checkpoint."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from megarl.errors import UserError
from megarl.models.spec import ModelSpec, load_spec

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
"""configs/models/NAME.json: HF config.json contents of model shapes used without a checkpoint."""

PRESETS: dict[str, dict[str, Any]] = {p.stem: json.loads(p.read_text()) for p in sorted(CONFIGS.glob("*.json"))}


def preset_or_hf_spec(name_or_dir: str, num_layers: int | None = None) -> ModelSpec:
    """A preset's spec, or the spec of a HF directory; ``num_layers`` keeps only the first layers."""
    if name_or_dir in PRESETS:
        config = dict(PRESETS[name_or_dir])
    elif Path(name_or_dir).is_dir():
        config = json.loads((Path(name_or_dir) / "config.json").read_text()) if (
            Path(name_or_dir) / "config.json").is_file() else {}
        if num_layers is None:
            return load_spec(name_or_dir)
    else:
        raise UserError(f"--model `{name_or_dir}` is neither a preset ({', '.join(PRESETS)}) nor a HF model "
                        "directory.")
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        return load_spec(tmp)
