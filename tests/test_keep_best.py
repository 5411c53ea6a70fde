"""checkpoint.keep_best: the best-scoring checkpoint survives rotation; the setting is checked when the config loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.checkpoint import checkpoints, rotate
from megarl.checkpoint.best_on_resume import check_best
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


def saved(root: Path, *steps: int) -> None:
    for step in steps:
        (root / f"step_{step:06d}").mkdir()


def test_a_damaged_best_json_stops_rotation_instead_of_deleting_the_best(tmp_path: Path, capsys) -> None:
    saved(tmp_path, 1, 2, 3)
    assert mark_best(tmp_path, METRIC, 1, {METRIC: 0.75})
    text = (tmp_path / "best.json").read_text()
    (tmp_path / "best.json").write_text(text[:len(text) // 2])  # truncated
    for act in (lambda: rotate(tmp_path, keep_last=1, saved=tmp_path / "step_000003"),
                lambda: mark_best(tmp_path, METRIC, 3, {METRIC: 0.0625}),
                lambda: check_best(tmp_path, METRIC, 4, 0)):
        with pytest.raises(UserError, match="best.json is damaged .*Fix: write it again"):
            act()
    assert sorted(checkpoints(tmp_path)) == [1, 2, 3]  # nothing deleted


def test_a_changed_metric_on_resume_is_refused(tmp_path: Path) -> None:
    saved(tmp_path, 1)
    mark_best(tmp_path, METRIC, 1, {METRIC: 0.75})
    with pytest.raises(UserError, match="on 'eval/gsm8k/accuracy', but checkpoint.keep_best = "
                                        "'eval/gsm8k/mean_length': values of two metrics do not compare"):
        check_best(tmp_path, "eval/gsm8k/mean_length", 2, 0)
    check_best(tmp_path, METRIC, 2, 0)  # the same metric: kept
    assert best_step(tmp_path) == 1


def test_a_best_this_run_trains_again_is_forgotten_with_a_line(tmp_path: Path, capsys) -> None:
    """The best was the latest checkpoint, damaged: the resume falls back to step 3 and trains step 4 again, so
    best.json's step 4 = 0.875 no longer describes step_000004 (the issue's run then scored it 0.1875)."""
    saved(tmp_path, 3, 4)
    mark_best(tmp_path, METRIC, 4, {METRIC: 0.875})
    check_best(tmp_path, METRIC, 4, 0)  # resumed from step 3
    assert "named step 4 (eval/gsm8k/accuracy = 0.875) as the best, but this run trains that step again" in \
        capsys.readouterr().out
    assert best_step(tmp_path) is None and (tmp_path / "best.json.stale").is_file()
    assert mark_best(tmp_path, METRIC, 4, {METRIC: 0.1875}) and best_step(tmp_path) == 4


def test_a_misspelled_metric_is_refused_when_the_config_loads() -> None:
    base = {"model": {"hf_path": "m"}, "data": {"train_path": "gsm8k"},
            "eval": {"every": 10, "num_samples": 4, "temperature": 1.0,
                     "datasets": [{"name": "gsm8k", "path": "gsm8k:test"}]}}
    for metric in ("accuracy", "pass@4", "mean@4"):
        build_config(base | {"checkpoint": {"dir": "d", "save_every": 20, "keep_best": f"eval/gsm8k/{metric}"}})
    # Also what eval/ logs but has no better end: keep_best kept the most truncated step and let the least go.
    for metric in ("acuracy", "truncated_fraction", "mean_length"):
        with pytest.raises(UserError, match="name a metric of eval/gsm8k where higher is better: accuracy, pass@4, "
                                            "mean@4"):
            build_config(base | {"checkpoint": {"dir": "d", "save_every": 20, "keep_best": f"eval/gsm8k/{metric}"}})
