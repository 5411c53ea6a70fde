"""checkpoint.keep_best: the best-scoring checkpoint survives rotation; the setting is checked when the config loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.checkpoint import checkpoints, rotate
from megarl.checkpoint.keep_best import best_step, mark_best
from megarl.config import build_config
from megarl.errors import UserError

METRIC = "eval/gsm8k/accuracy"


def test_the_best_checkpoint_stays_outside_rotation(tmp_path: Path) -> None:
    scores = {9: 0.30, 19: 0.55, 29: 0.41, 39: 0.52, 49: 0.55}  # step 19 stays the best (49 only ties it)
    for step, score in scores.items():
        (tmp_path / f"step_{step:06d}").mkdir()
        rotate(tmp_path, keep_last=2, saved=tmp_path / f"step_{step:06d}")
        mark_best(tmp_path, METRIC, step, {METRIC: score})
    assert best_step(tmp_path) == 19
    assert sorted(checkpoints(tmp_path)) == [19, 39, 49]
    assert not mark_best(tmp_path, METRIC, 59, {METRIC: 0.9})  # no checkpoint of step 59
    assert not mark_best(tmp_path, METRIC, 49, {"eval/other/accuracy": 0.9})


def test_keep_best_is_checked_when_the_config_loads() -> None:
    base = {"model": {"hf_path": "m"}, "data": {"train_path": "gsm8k"},
            "eval": {"every": 10, "datasets": [{"name": "gsm8k", "path": "gsm8k:test"}]}}
    ok = build_config(base | {"checkpoint": {"dir": "d", "save_every": 20, "keep_best": METRIC}})
    assert ok.checkpoint.keep_best == METRIC
    with pytest.raises(UserError, match="keep_best` = \"eval/math/accuracy\".*eval dataset \\(gsm8k\\)"):
        build_config(base | {"checkpoint": {"dir": "d", "save_every": 20, "keep_best": "eval/math/accuracy"}})
    with pytest.raises(UserError, match="save_every` = 15, but it must be a multiple of eval.every = 10"):
        build_config(base | {"checkpoint": {"dir": "d", "save_every": 15, "keep_best": METRIC}})
