"""A run's closing summary and plot, rebuilt from its metrics.jsonl.

  python -m megarl.report RUN_DIR

Prints where everything is (metrics, mlflow store, engine logs, checkpoints), the reward of the first and last steps
and the median time of each phase, and writes RUN_DIR/metrics.png: reward, rollout/trainer logprob gap
and phase times per step. Training prints the same at its end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megarl.errors import UserError
from megarl.run.command import run_main

WINDOW = 10
"""Steps averaged for "first" and "last"."""


def read_rows(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path} does not exist: RUN_DIR must be a run's checkpoint.dir (where metrics.jsonl is).")
    lines = [(number, line) for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    rows = []
    for number, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if number == lines[-1][0]:  # what a run killed while it wrote a row leaves
                print(f"megarl: {path} line {number} is cut short ({line[:60]!r}), as a run killed while writing it "
                      "leaves it; the report leaves it out", flush=True)
                break
            raise UserError(f"{path} line {number} is damaged ({err.msg}: {line[:80]!r}); only the last line may be "
                            "cut short (a run killed while writing it), and the report skips that one. Fix: delete "
                            f"or repair line {number}.") from None
        fields = row if isinstance(row, dict) else {}
        missing = [key for key in ("step", "reward_mean") if not isinstance(fields.get(key), (int, float))]
        if missing:
            raise UserError(f"{path} line {number} is not a training step's metrics: it has no numeric "
                            f"{' or '.join(missing)} ({line[:80]!r}). Fix: RUN_DIR must be the checkpoint.dir of a "
                            f"megarl.train run, whose every line has both; delete or repair line {number}.")
        rows.append(row)
    if not rows:
        raise UserError(f"{path} holds no steps yet.")
    return rows


def summary(run_dir: Path, rows: list[dict[str, float]], plot_note: str | None = None) -> str:
    """``plot_note``: why metrics.png is missing, when it is."""
    first, last = rows[:WINDOW], rows[-WINDOW:]

    def mean(part: list[dict[str, float]], key: str) -> float:
        return sum(r.get(key, r["reward_mean"]) for r in part) / len(part)

    reward, what = policy_reward(rows)

    phases = ran_phases(rows)
    times = ", ".join(f"{k[5:]} {phase_median(rows, k):.2f}s" for k in phases)
    lines = [f"megarl: {len(rows)} steps (steps {rows[0]['step']}-{rows[-1]['step']}) in {run_dir}",
             f"  {what} {mean(first, reward):.3f} (first {len(first)} steps) -> "
             f"{mean(last, reward):.3f} (last {len(last)})",
             *eval_lines(rows),
             f"  median phase times (over the steps that ran each): {times}",
             f"  metrics: {run_dir / 'metrics.jsonl'}, plot: {plot_note or run_dir / 'metrics.png'}"]
    store = run_dir / "mlflow.db"
    if store.is_file():
        lines.append(f"  mlflow: {store} (mlflow ui --backend-store-uri sqlite:///{store.resolve()})")
    engine_logs = sorted(run_dir.glob("engine_*.log"))
    if engine_logs:
        lines.append(f"  engine logs: {', '.join(str(p) for p in engine_logs)}")
    # complete ones only: not a resume set aside as step_N.damaged (megarl.checkpoint, which imports torch)
    checkpoints = sorted(p for p in run_dir.glob("step_*") if p.name[5:].isdigit() and p.is_dir())
    if checkpoints:
        lines.append(f"  checkpoints: {', '.join(p.name for p in checkpoints)} in {run_dir} "
                     f"(export: python -m megarl.convert mcore-to-hf --ckpt {checkpoints[-1] / 'actor'} --out DIR)")
    return "\n".join(lines)


def policy_reward(rows: list[dict[str, float]]) -> tuple[str, str]:
    """(key, label) of the policy's mean reward: with algorithm.dynamic_sampling, reward_mean is the kept batch's,
    whose groups the filter chose for their spread (0.5 with two samples a prompt, however the policy does); the
    samples drawn are sampling/reward_mean_drawn."""
    if any("sampling/reward_mean_drawn" in r for r in rows):
        return "sampling/reward_mean_drawn", "reward of the samples drawn"
    return "reward_mean", "reward"


RAN_SECONDS = 0.005
"""A phase's time in a step where it did work: one entered with nothing to do (the critic of a GRPO run, the teacher
without distillation, an evaluation between its steps) takes microseconds."""


def ran_phases(rows: list[dict[str, float]]) -> list[str]:
    """The time/* keys of phases that did work in some step."""
    keys = sorted({k for r in rows for k in r if k.startswith("time/")})
    return [k for k in keys if max(r.get(k, 0.0) for r in rows) >= RAN_SECONDS]


def phase_median(rows: list[dict[str, float]], key: str) -> float:
    """``key``'s median over the steps that did its work (an evaluation every few steps was a median of 0.00 s)."""
    return statistics.median([r[key] for r in rows if r.get(key, 0.0) >= RAN_SECONDS] or [0.0])


def eval_curve(rows: list[dict[str, float]], name: str) -> list[tuple[int, float]]:
    """(updates applied, accuracy) of eval set ``name``: its initial evaluation at 0, step N's at N + 1."""
    points = [(0, r[f"eval/{name}/initial/accuracy"]) for r in rows if f"eval/{name}/initial/accuracy" in r]
    return points + [(int(r["step"]) + 1, r[f"eval/{name}/accuracy"]) for r in rows if f"eval/{name}/accuracy" in r]


def eval_names(rows: list[dict[str, float]]) -> list[str]:
    return sorted({k.split("/")[1] for r in rows for k in r if k.startswith("eval/") and k.endswith("/accuracy")})


def eval_lines(rows: list[dict[str, float]]) -> list[str]:
    """Per eval set: first, best and last held-out accuracy, with the number of updates behind each."""
    lines = []
    for name in eval_names(rows):
        curve = eval_curve(rows, name)
        best = max(curve, key=lambda p: p[1])
        lines.append(f"  eval {name}: accuracy {curve[0][1]:.3f} (after {curve[0][0]} updates) -> best "
                     f"{best[1]:.3f} (after {best[0]}) -> last {curve[-1][1]:.3f} (after {curve[-1][0]})")
    return lines


def plot(run_dir: Path, rows: list[dict[str, float]]) -> Path:
    """metrics.png: reward, held-out accuracy (with eval sets), logprob gap and phase times against the step;
    written atomically. Drawn on a Figure of its own (pyplot keeps global state), with matplotlib blind to a stand-in
    IPython module: some images install one to satisfy an import, and matplotlib's IPython hooks fail on it."""
    import matplotlib

    matplotlib.use("Agg")
    with _without_stand_in_ipython():
        return _draw(run_dir, rows)


@contextmanager
def _without_stand_in_ipython() -> Iterator[None]:
    ipython = sys.modules.get("IPython")
    stand_in = ipython is not None and not isinstance(getattr(ipython, "version_info", None), tuple)
    if stand_in:
        del sys.modules["IPython"]
    try:
        yield
    finally:
        if stand_in:
            sys.modules["IPython"] = ipython  # type: ignore[assignment]


def _draw(run_dir: Path, rows: list[dict[str, float]]) -> Path:
    from matplotlib.figure import Figure

    steps = [r["step"] for r in rows]
    names = eval_names(rows)
    fig = Figure(figsize=(8, 9 + 3 * bool(names)))
    axes = fig.subplots(3 + bool(names), 1, sharex=True)
    reward, what = policy_reward(rows)
    axes[0].plot(steps, [r.get(reward, r["reward_mean"]) for r in rows])
    axes[0].set_ylabel(f"mean {what}")
    if names:  # accuracy after N + 1 updates sits at step N, the initial one at step -1
        for name in names:
            curve = eval_curve(rows, name)
            axes[1].plot([u - 1 for u, _ in curve], [a for _, a in curve], marker="o", label=name)
        axes[1].set_ylabel("held-out accuracy")
        axes[1].legend(fontsize="small")
    axes[-2].semilogy(steps, [max(r.get("logprob_diff_max", 0.0), 1e-12) for r in rows])
    axes[-2].set_ylabel("max |rollout - trainer|\nlogprob")
    # The first step (compilation, graph capture, an empty pool) is drawn apart, as a point, so that it does not
    # flatten the steady steps; phases that never ran (a GRPO run's critic) are left out.
    for key in ran_phases(rows):
        values = [r.get(key, float("nan")) for r in rows]
        line, = axes[-1].plot(steps[1:], values[1:], label=key[5:], linewidth=2.5 if key == "time/step" else 1.0,
                              color="black" if key == "time/step" else None)
        axes[-1].plot(steps[:1], values[:1], marker="x", linestyle="none", color=line.get_color())
    if len(rows) > 1:
        axes[-1].set_ylim(0, 1.15 * max(r.get(k, 0.0) for r in rows[1:] for k in ran_phases(rows)))
        first = rows[0].get("time/step", sum(rows[0].get(k, 0.0) for k in ran_phases(rows)))
        axes[-1].set_title(f"first step (x, may lie above): {first:.1f} s", fontsize="small")
    axes[-1].set_ylabel("seconds")
    axes[-1].set_xlabel("step")
    axes[-1].legend(fontsize="small", ncol=3)
    fig.tight_layout()
    out = run_dir / "metrics.png"
    tmp = run_dir / ".metrics.png.tmp"
    fig.savefig(tmp, format="png", dpi=100)
    tmp.replace(out)
    return out


def report(run_dir: Path) -> str:
    """Write the plot and return the summary."""
    rows = read_rows(run_dir)
    try:
        plot(run_dir, rows)
    except Exception as err:  # a plot is a convenience: it never turns a finished run into a failed one
        return summary(run_dir, rows, plot_note=f"not written ({type(err).__name__}: {err})")
    return summary(run_dir, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megarl.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run's checkpoint.dir (holding metrics.jsonl)")
    args = parser.parse_args(argv)
    print(report(Path(args.run_dir)), flush=True)


if __name__ == "__main__":
    run_main(main)
