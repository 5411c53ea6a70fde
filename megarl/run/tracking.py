"""Run tracking: per-step metrics to the console (rich), to metrics.jsonl, and to mlflow when enabled.

Every step logs, under the same names in metrics.jsonl and mlflow: reward_mean, reward_std, response_length, entropy
(mean -log p of the sampled response tokens: the policy's entropy in expectation when sampling at temperature 1,
with no extra forward pass), logprob_diff_mean/max (rollout engine vs trainer), kl and kl_coef (with a reference
model), actor/* and critic/* from the updates (loss, policy_loss, clip_fraction, value_loss, grad_norm, lr, ...),
time/<phase> in seconds (generate, reward_model: a reward model's scores, score: old logprobs, reference, critic:
values and update, update: the actor's, reshard), time/step (the step's wall time: from its first phase to its row,
whatever ran between the phases included), tokens (prompt + response tokens of the step) and tokens_per_s (tokens
over the step's wall time without its held-out evaluation, time/step - time/eval).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megarl.config import Config, TrackingConfig
from megarl.distributed.rank0 import from_rank0
from megarl.errors import UserError
from megarl.platform.device import host_memory
from megarl.run import interrupt
from megarl.run.lock import held_by_another


class Tracker:
    """Rank 0 logs; every rank times phases (the collective calls inside keep them in step)."""

    def __init__(self, cfg: Config, rank: int, out_dir: Path, start_step: int = 0, run_id: str | None = None,
                 unlogged: dict[str, Any] | None = None) -> None:
        """``run_id``: the mlflow run to continue (a resumed training run), else a new one. ``unlogged``: what the
        checkpoint of step start_step - 1 holds of that step when its row was not logged (a stop in the
        evaluation after the save): {"row": the row before it, "evaluate": whether it was due}; the resumed run
        finishes and logs it."""
        self.cfg, self.rank, self.start_step, self.out_dir = cfg, rank, start_step, out_dir
        self.unlogged = unlogged
        first = start_step - 1 if unlogged is not None else start_step  # the first step this run logs
        self.started = time.monotonic()
        self.times: dict[str, float] = {}
        self.last: dict[str, float] = {}
        """Each phase's seconds the last time it ran (``times`` adds up a step's)."""
        self.step_started: float | None = None
        """When the first phase of the step being timed began (perf_counter); None between a row and the next phase."""
        self.memory: dict[str, float] = {}
        self.history: list[dict[str, float]] = []
        self.mlflow: Any = None
        self.run_id: str | None = None
        self.jsonl = None
        if rank != 0:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        forget_jsonl_steps(out_dir, first)
        self.jsonl = open(out_dir / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
        from rich.console import Console

        self.console = Console(stderr=True, soft_wrap=True)  # one line per step in captured logs too
        if cfg.tracking.backend == "mlflow":
            self.mlflow = start_mlflow(cfg, out_dir, run_id, first)
            self.run_id = self.mlflow.active_run().info.run_id

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps so that a resumed run logs into the same mlflow run (rank 0)."""
        return {"mlflow_run_id": self.run_id}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase of the step; a phase entered twice in one step (the critic's) adds up. On GPUs also
        its memory peaks: this process's tensors (``memory/NAME_trainer_gib``) and the whole device's use,
        engines included, at its end (``memory/NAME_device_gib``), and the node's host memory in use then
        (``memory/NAME_host_gib``), each the largest over the step."""
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        if self.step_started is None:
            self.step_started = start
        with torch.profiler.record_function(f"phase/{name}"):  # names the phase in a --profile trace
            yield
        if cuda:
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            for key, value in ((f"memory/{name}_trainer_gib", torch.cuda.max_memory_allocated() / 2**30),
                               (f"memory/{name}_device_gib", (total - free) / 2**30),
                               (f"memory/{name}_host_gib", (host_memory() or (0, 0))[1] / 2**30)):
                self.memory[key] = max(self.memory.get(key, 0.0), value)
        key, self.last[name] = f"time/{name}", time.perf_counter() - start
        self.times[key] = self.times.get(key, 0.0) + self.last[name]

    def row(self, step: int, batch: Any, metrics: dict[str, float]) -> dict[str, float]:
        """Step ``step``'s row as it stands: the batch's statistics, ``metrics`` and the phases' times so far, and
        the step's wall time so far (the sum of its phases would miss what runs between them)."""
        tokens = sum(len(s) for s in batch.sequences)
        response_tokens = batch.mask.sum().clamp(min=1)
        wall = time.perf_counter() - self.step_started if self.step_started is not None else 0.0
        trained = wall - self.times.get("time/eval", 0.0)
        return {"step": step, "reward_mean": float(batch.scores.mean()), "reward_std": float(batch.scores.std()),
                "response_length": float(batch.mask.sum(dim=1).mean()),
                "entropy": float(-(batch.rollout_logprobs * batch.mask).sum() / response_tokens),
                "tokens": float(tokens), "tokens_per_s": tokens / max(trained, 1e-9), **metrics, **self.times,
                "time/step": wall}

    def log(self, step: int, batch: Any, metrics: dict[str, float]) -> None:
        self.write(self.row(step, batch, metrics))

    def write(self, row: dict[str, float]) -> None:
        """Log ``row`` (from ``row``) with the phases' times and memory peaks since the last row."""
        step = int(row["step"])
        if self.unlogged is not None and step == self.start_step - 1 and self.step_started is not None:
            # the checkpoint's row, its wall time taken up to the save: this process's part (the evaluation) adds to
            # it, so that time/step - time/eval stays the trained part
            row = row | {"time/step": row.get("time/step", 0.0) + time.perf_counter() - self.step_started}
        times, self.times, self.step_started = self.times, {}, None
        memory, self.memory = _max_over_ranks(self.memory), {}
        row = row | times | memory
        self.history.append(row)
        if self.rank != 0:
            return
        assert self.jsonl is not None
        write_row(self.jsonl, self.mlflow, step, row)
        if (step + 1) % self.cfg.trainer.log_every and step + 1 != self.cfg.trainer.num_steps:
            return
        drawn = row.get("sampling/reward_mean_drawn")  # dynamic sampling: the kept batch's mean is chosen
        self.console.print(
            f"[bold]step {step + 1}/{self.cfg.trainer.num_steps}[/] reward {row['reward_mean']:.3f} "
            + (f"(drawn {drawn:.3f}) " if drawn is not None else "")
            + f"len {row['response_length']:.1f} kl {row.get('kl', 0.0):.4f} "
            f"clip {row.get('actor/clip_fraction', 0.0):.3f} gnorm {row.get('actor/grad_norm', 0.0):.3f} "
            f"lp-diff {row['logprob_diff_max']:.2e} | " + " ".join(
                f"{k[5:]} {v:.2f}s" for k, v in times.items()) + f" | step {row['time/step']:.2f}s"
            f" {row['tokens_per_s']:.0f} tok/s"
            + "".join(f" | eval {k.split('/')[1]} {v:.3f}" for k, v in row.items()
                      if k.startswith("eval/") and k.endswith("/accuracy") and "/initial/" not in k)
            + f" | ETA {self._eta(step)}")

    def _eta(self, step: int) -> str:
        """Time left at the mean pace of this process's steps so far (the first, with compilation, included)."""
        done = step + 1 - self.start_step
        left = self.cfg.trainer.num_steps - step - 1
        seconds = int((time.monotonic() - self.started) / max(done, 1) * left)
        return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"

    def end_with_the_process(self) -> None:
        """However the process ends, the mlflow run ends with it, KILLED or FAILED (``close_with_the_process``);
        ``close`` gives FINISHED after the last step."""
        close_with_the_process(self.close)

    def close(self, status: str = "FINISHED") -> None:
        """Close metrics.jsonl and end the mlflow run with ``status``: FINISHED after the last step, FAILED after
        an error, KILLED after a signal. Once: a second call does nothing. From another thread too (an engine
        call's deadline ends the run from its timer's), where mlflow's active run, kept per thread, is unknown."""
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.mlflow is not None:
            mlflow, self.mlflow = self.mlflow, None
            end_mlflow_run(mlflow, self.run_id, status)


def write_row(jsonl: Any, mlflow: Any, step: int, row: dict[str, Any]) -> None:
    """Step ``step``'s ``row`` to metrics.jsonl and, with ``mlflow`` (the module, or None), to the mlflow run."""
    with interrupt.deferred():  # the row reaches both, and the store is left unlocked for the clean-up
        jsonl.write(json.dumps({"step": step} | row) + "\n")
        jsonl.flush()
        if mlflow is not None:
            mlflow.log_metrics({mlflow_name(k): v for k, v in row.items() if k != "step"}, step=step)


def mlflow_name(key: str) -> str:
    """``key`` as mlflow takes a metric's name (letters, digits and ``_-. :/``; it refused ``eval/gsm8k/pass@4``
    and failed the run at its first evaluation): ``@`` reads ``_at_``, anything else it refuses ``_``."""
    return re.sub(r"[^\w\-. :/]", "_", key.replace("@", "_at_"), flags=re.ASCII)


def close_with_the_process(close: Callable[..., None]) -> None:
    """However the process ends, ``close(status=...)`` ends the mlflow run with it: KILLED after a signal
    (megarl.run.interrupt), FAILED after an error (megarl.errors.at_failure), also another rank's, after which
    torchrun sends this one SIGTERM (the launcher's error file holds it). FINISHED, after the last step, is the
    caller's own call."""
    from megarl.errors import at_failure

    interrupt.at_interrupt(lambda: close(status=interrupted_status()))
    at_failure(lambda: close(status="FAILED"))


def end_mlflow_run(mlflow: Any, run_id: str | None, status: str) -> None:
    """End mlflow run ``run_id`` with ``status``, from any thread: mlflow keeps the active run per thread."""
    run = mlflow.active_run()
    if run is not None and run.info.run_id == run_id:
        mlflow.end_run(status=status)  # else mlflow's exit hook would end it once more, as FINISHED
    else:
        mlflow.MlflowClient().set_terminated(run_id, status=status)


class Recipe(Protocol):
    """What mlflow needs of a recipe: an RL run's Config, or reward-model training's."""

    @property
    def tracking(self) -> TrackingConfig: ...

    def to_flat_dict(self) -> dict[str, Any]: ...


def open_store(cfg: Recipe, out_dir: Path) -> Any:
    """Point mlflow at the configured store and experiment (creating them); the mlflow module. Cheap:
    bootstrap calls it before building anything, so a bad tracking.uri costs no start-up time."""
    t = cfg.tracking
    try:
        import mlflow
        from mlflow.exceptions import MlflowException
        from sqlalchemy.exc import SQLAlchemyError
    except ImportError as err:
        raise UserError(f"tracking.backend = mlflow but {err.name} is not installed. Fix: `pip install -r "
                        "requirements.txt`, or set tracking.backend: none (metrics still go to metrics.jsonl)."
                        ) from None
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # not its schema migrations on every start
    uri = t.uri or f"sqlite:///{(out_dir / 'mlflow.db').resolve()}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(t.experiment)
    except (MlflowException, SQLAlchemyError, OSError) as err:
        detail = " ".join(str(err).split())[:300]
        raise UserError(f"tracking.uri = {t.uri!r}: mlflow could not open the store {uri!r} ({type(err).__name__}: "
                        f"{detail}). Fix: set tracking.uri to a writable sqlite:////abs/path/mlflow.db or a reachable "
                        "http(s):// server, null for mlflow.db in checkpoint.dir, or tracking.backend: none.") from err
    return mlflow


def logged(out_dir: Path, step: int, rank: int) -> bool:
    """Whether metrics.jsonl holds step ``step``'s row: rank 0 reads it, every rank gets its answer."""
    path = out_dir / "metrics.jsonl"

    def read() -> bool:
        if not path.is_file():
            return False
        rows, _ = read_jsonl_rows(path, [line for line in path.read_text().splitlines() if line.strip()])
        return any(row["step"] == step for row in rows)

    return from_rank0(read, rank)


def forget_jsonl_steps(out_dir: Path, start_step: int) -> None:
    """Make metrics.jsonl hold only steps before ``start_step``: a run resumed from a checkpoint logs the
    steps after it again. Rows dropped are appended to metrics.discarded.jsonl first, so none is lost; so is a
    last line cut short by a crash while it was written (a damaged line anywhere else is an error)."""
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows, cut = read_jsonl_rows(path, lines)
    kept = [line for line, row in zip(lines, rows, strict=False) if row["step"] < start_step]
    if len(kept) == len(lines):
        return
    dropped = [line for line, row in zip(lines, rows, strict=False) if row["step"] >= start_step] + cut
    with open(out_dir / "metrics.discarded.jsonl", "a") as f:
        f.write("".join(line + "\n" for line in dropped))
    tmp = out_dir / ".metrics.jsonl.tmp"
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)
    if cut:
        print(f"megarl: the last line of {path} was cut short (a crash while it was written: {cut[0][:60]!r}); "
              "it moved to metrics.discarded.jsonl", flush=True)
    if len(dropped) > len(cut):
        print(f"megarl: metrics.jsonl holds steps before {start_step} only; {len(dropped) - len(cut)} rows logged "
              "after the checkpoint this run starts from moved to metrics.discarded.jsonl", flush=True)


def read_jsonl_rows(path: Path, lines: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of metrics.jsonl's ``lines``, and the last line if a crash cut it short (else nothing)."""
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not a metrics row with an integer step")
        except ValueError as err:
            if number == len(lines):
                return rows, [line]
            raise UserError(f"{path} line {number} is damaged ({err}: {line[:80]!r}); only its last line may be "
                            "(cut short by a crash), which a resume drops. Fix: delete or repair that line, or move "
                            "the file away to start a new one (the mlflow run keeps the metrics too).") from None
        rows.append(row)
    return rows, []


def forget_mlflow_steps(uri: str, run_id: str, start_step: int) -> int | None:
    """Delete run ``run_id``'s metrics of steps >= ``start_step`` from an SQLite store (mlflow's API cannot
    delete metrics) and recompute its latest values; the number of values deleted, None for other stores."""
    if not uri.startswith("sqlite:///"):
        return None
    with sqlite3.connect(uri[len("sqlite:///"):]) as db:
        deleted = db.execute("DELETE FROM metrics WHERE run_uuid = ? AND step >= ?", (run_id, start_step)).rowcount
        if deleted:
            db.execute("DELETE FROM latest_metrics WHERE run_uuid = ?", (run_id,))
            db.execute("""INSERT OR REPLACE INTO latest_metrics (key, value, timestamp, step, is_nan, run_uuid)
                SELECT key, value, timestamp, step, is_nan, run_uuid FROM metrics AS m WHERE run_uuid = ?
                AND NOT EXISTS (SELECT 1 FROM metrics AS o WHERE o.run_uuid = m.run_uuid AND o.key = m.key
                                AND (o.step, o.timestamp, o.value) > (m.step, m.timestamp, m.value))""", (run_id,))
    return deleted


def start_mlflow(cfg: Recipe, out_dir: Path, run_id: str | None = None, start_step: int = 0) -> Any:
    """Open the store, start (or continue) a run and log the flattened config as params; the mlflow module.
    A continued run first forgets the steps from ``start_step`` on, which the resumed run logs again."""
    mlflow = open_store(cfg, out_dir)
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    # mlflow caps param values; the full config is in the recipe, so a long value (a path) is cut, marked with ...
    params = {k: str(v) if len(str(v)) <= MAX_PARAM_VAL_LENGTH else str(v)[: MAX_PARAM_VAL_LENGTH - 3] + "..."
              for k, v in cfg.to_flat_dict().items()}
    if run_id is not None:
        try:
            logged = mlflow.get_run(run_id).data.params
        except MlflowException:
            print(f"megarl: mlflow run {run_id} of the checkpoint is not in this store; starting a new run",
                  flush=True)
            run_id = None
    if run_id is None:
        mlflow.start_run(run_name=cfg.tracking.run_name)
        mlflow.log_params(params)
        return mlflow
    if forget_mlflow_steps(mlflow.get_tracking_uri(), run_id, start_step) is None:
        print(f"megarl: the mlflow server keeps what run {run_id} logged from step {start_step} on before it was "
              "interrupted (mlflow cannot delete metrics); metrics.jsonl holds each step once", flush=True)
    mlflow.start_run(run_id=run_id)
    # A run's params are immutable: a resumed run adds new keys and reports changed ones.
    changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
    if changed:
        print(f"megarl: resumed mlflow run {run_id} keeps its original params for {', '.join(changed)}", flush=True)
    mlflow.log_params({k: v for k, v in params.items() if k not in logged})
    return mlflow


def _max_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Each value's maximum over all ranks (every rank holds the same keys: the phases run everywhere)."""
    if not values or not dist.is_initialized():
        return values
    keys = sorted(values)
    tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64, device="cuda")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return dict(zip(keys, tensor.tolist(), strict=True))


def interrupted_status() -> str:
    """An interrupt's mlflow status: KILLED, or FAILED when another rank's error caused it (torchrun's SIGTERM after
    that rank's paragraph reached the launcher's error file)."""
    from megarl.errors import ERROR_FILE

    errors = os.environ.get(ERROR_FILE)
    return "FAILED" if errors and os.path.isfile(errors) and os.path.getsize(errors) else "KILLED"


def record_if_it_ends(cfg: Recipe, out_dir: Path) -> Callable[[], None]:
    """From the moment the config is read until the run's own mlflow run takes over (the call returned): a run that
    ends with an error or an interrupt is recorded as an mlflow run with the config's params, FAILED or KILLED, as a
    later end would be (a start-up error or a Ctrl-C before the first step used to leave no run). Rank 0 only."""
    from megarl.errors import at_failure

    taken_over = cfg.tracking.backend != "mlflow" or os.environ.get("RANK", "0") != "0"

    def end(status: str) -> None:
        # A run refused because another holds its directory (megarl.run.lock) writes nothing into that run's store.
        if taken_over or held_by_another(out_dir):
            return
        try:
            mlflow = start_mlflow(cfg, out_dir)
        except UserError:  # a store that cannot be opened records nothing: the run's own error says what matters
            return
        mlflow.end_run(status=status)

    def take_over() -> None:
        nonlocal taken_over
        taken_over = True

    at_failure(lambda: end("FAILED"))
    interrupt.at_interrupt(lambda: end(interrupted_status()))
    return take_over
