"""`python -m megarl.report RUN_DIR`: the closing summary and plot, rebuilt from metrics.jsonl."""

import json
import subprocess
import sys

from helpers import REPO


def test_report_from_metrics(tmp_path):
    rows = [{"step": s, "reward_mean": 0.1 if s < 10 else 0.5, "logprob_diff_max": 1e-5, "time/generate": 2.0,
             "time/update": 1.0 + s % 2} for s in range(30)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "step_000029" / "actor").mkdir(parents=True)
    (tmp_path / "step_000019.damaged" / "actor").mkdir(parents=True)  # set aside by a resume: not a checkpoint
    proc = subprocess.run([sys.executable, "-m", "megarl.report", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert "30 steps" in proc.stdout and "reward 0.100 (first 10 steps) -> 0.500 (last 10)" in proc.stdout
    assert "generate 2.00s, update 1.50s" in proc.stdout and "step_000029" in proc.stdout
    assert "damaged" not in proc.stdout
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = subprocess.run([sys.executable, "-m", "megarl.report", str(tmp_path / "nothing")], cwd=REPO,
                          capture_output=True, text=True, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "metrics.jsonl does not exist" in proc.stderr


def test_the_summary_and_plot_leave_out_phases_that_never_ran_and_set_the_first_step_apart(tmp_path):
    from megarl.report import plot, ran_phases, summary

    rows = [{"step": s, "reward_mean": 0.1, "time/generate": 2.0, "time/critic": 2e-6, "time/teacher": 0.0,
             "time/step": 60.0 if s == 0 else 3.5} for s in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ran_phases(rows) == ["time/generate", "time/step"]
    text = summary(tmp_path, rows)
    assert "generate 2.00s, step 3.50s" in text and "critic" not in text and "teacher" not in text
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    drawn: list = []
    original = Figure.savefig
    Figure.savefig = lambda fig, *a, **k: (drawn.append(fig), original(fig, *a, **k))[1]  # type: ignore[method-assign]
    try:
        plot(tmp_path, rows)
    finally:
        Figure.savefig = original  # type: ignore[method-assign]
    timing = drawn[0].axes[-1]
    assert timing.get_ylim()[1] < 10  # the 60 s first step does not flatten the steady 3.5 s ones
    assert "first step" in timing.get_title() and "60.0 s" in timing.get_title()
    assert sorted(t.get_text() for t in timing.get_legend().get_texts()) == ["generate", "step"]


def test_the_summary_gives_each_phase_its_median_over_the_steps_that_ran_it(tmp_path):
    """An evaluation every few steps had a median of 0.00 s over all steps."""
    from megarl.report import summary

    rows = [{"step": s, "reward_mean": 0.1, "time/generate": 2.0, "time/eval": 30.0 if s % 5 == 4 else 0.0,
             "time/step": 3.5} for s in range(10)]
    assert "eval 30.00s, generate 2.00s, step 3.50s" in summary(tmp_path, rows)


def test_under_dynamic_sampling_the_summary_follows_the_samples_drawn_not_the_kept_batch(tmp_path):
    """The filter keeps groups for their spread: the kept batch's reward_mean is 0.5 with two samples a prompt,
    however the policy does, and the summary read it as a flat reward."""
    from megarl.report import summary

    rows = [{"step": s, "reward_mean": 0.5, "sampling/reward_mean_drawn": 0.05 + 0.04 * s} for s in range(20)]
    assert "reward of the samples drawn 0.230 (first 10 steps) -> 0.630 (last 10)" in summary(tmp_path, rows)


def test_a_broken_plotting_library_does_not_fail_the_run(tmp_path):
    """The summary still prints, says why the plot is missing, and the exit code stays 0 (a GPU image
    had a matplotlib that could not plot, and a finished 10-step run exited 1)."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward_mean": 0.2, "time/generate": 1.0}) + "\n")
    stub = tmp_path / "stub"
    (stub / "matplotlib").mkdir(parents=True)
    (stub / "matplotlib" / "__init__.py").write_text("def use(name):\n    raise RuntimeError('no backend')\n")
    proc = subprocess.run([sys.executable, "-m", "megarl.report", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, env={"PYTHONPATH": f"{stub}:{REPO}"})
    assert proc.returncode == 0, proc.stderr
    assert "reward 0.200" in proc.stdout and "plot: not written (RuntimeError: no backend)" in proc.stdout


def test_the_plot_is_drawn_beside_an_imported_stand_in_ipython(tmp_path):
    """The H200 image's staging put a stand-in IPython in sys.modules (every attribute an object that cannot be
    indexed); pyplot hooked into it and every run's plot failed with "'_Any' object is not subscriptable"."""
    rows = [{"step": s, "reward_mean": 0.1 * s, "time/generate": 1.0} for s in range(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = ("import sys, types\n"
            "class Any_:\n"
            "    def __getattr__(self, name): return Any_()\n"
            "    def __call__(self, *a, **k): return Any_()\n"
            "ipython = types.ModuleType('IPython'); ipython.__getattr__ = lambda name: Any_()\n"
            "sys.modules['IPython'] = ipython\n"
            "from pathlib import Path; from megarl.report import plot, read_rows\n"
            f"run = Path({str(tmp_path)!r}); print(plot(run, read_rows(run)))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "metrics.png").stat().st_size > 1000


def report_of(run_dir, text):
    (run_dir / "metrics.jsonl").write_text(text)
    return subprocess.run([sys.executable, "-m", "megarl.report", str(run_dir)], cwd=REPO, capture_output=True,
                          text=True, env={"PYTHONPATH": str(REPO)})


def test_a_last_line_cut_short_by_a_killed_run_is_skipped_with_a_line_saying_so(tmp_path):
    rows = "".join(json.dumps({"step": s, "reward_mean": 0.5, "time/generate": 1.0}) + "\n" for s in range(3))
    proc = report_of(tmp_path, rows + '{"step": 3, "reward_me')
    assert proc.returncode == 0, proc.stderr
    assert f"megarl: {tmp_path / 'metrics.jsonl'} line 4 is cut short" in proc.stdout
    assert "3 steps (steps 0-2)" in proc.stdout


def test_a_damaged_line_or_a_row_without_the_metrics_is_one_paragraph_naming_the_line(tmp_path):
    """JSONDecodeError and KeyError 'reward_mean' tracebacks before."""
    row = json.dumps({"step": 0, "reward_mean": 0.5}) + "\n"
    path = tmp_path / "metrics.jsonl"
    for text, expected in [(row + "garbage\n" + row, f"{path} line 2 is damaged (Expecting value: 'garbage')"),
                           (row + "\n" + json.dumps({"step": "x", "reward": "y"}) + "\n",
                            f"{path} line 3 is not a training step's metrics: it has no numeric step or reward_mean"),
                           ("[1, 2]\n", f"{path} line 1 is not a training step's metrics")]:
        proc = report_of(tmp_path, text)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        message = proc.stderr.strip()
        assert expected in message and "Fix:" in message and "\n" not in message, message
