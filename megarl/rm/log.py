"""The metrics of reward-model training: metrics.jsonl in the run directory (each step once, across resumes),
mlflow (tracking.backend), and one console line per trainer.log_every steps. Rank 0 writes; the others keep
nothing. As train.py's Tracker, each row reaches both whole and the mlflow run ends with the process: FINISHED,
FAILED or KILLED (megarl.run.tracking)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megarl.config.reward_training import RewardTrainingConfig
from megarl.run.tracking import close_with_the_process, end_mlflow_run, forget_jsonl_steps, start_mlflow, write_row


class RewardLog:
    def __init__(self, cfg: RewardTrainingConfig, out_dir: Path, rank: int) -> None:
        self.cfg, self.out_dir, self.rank = cfg, out_dir, rank
        self.run_id: str | None = None
        self.mlflow: Any = None
        self.jsonl: Any = None
        self.initial: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def resumed(self, path: Path, first: int, run_id: str | None) -> None:
        self.run_id = run_id
        if self.rank == 0:
            print(f"megarl: resumed from {path} at step {first}", flush=True)

    def open(self, first: int) -> None:
        """Start logging at step ``first``: rows of later steps a stopped run had logged move aside."""
        if self.rank != 0:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        forget_jsonl_steps(self.out_dir, first)
        self.jsonl = open(self.out_dir / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
        close_with_the_process(self.close)  # before the mlflow run starts: a signal as it starts still ends it
        if self.cfg.tracking.backend == "mlflow":
            self.mlflow = start_mlflow(self.cfg, self.out_dir, self.run_id, first)
            self.run_id = self.mlflow.active_run().info.run_id

    def write(self, step: int, row: dict[str, float]) -> None:
        """Step ``step``'s row (-1: the held-out pairs before training, logged with step 0 as eval/initial/*)."""
        if self.rank != 0:
            return
        if step < 0:
            self.initial = {k.replace("eval/", "eval/initial/", 1): v for k, v in row.items()}
            self._console(f"before training: held-out accuracy {row['eval/accuracy']:.3f} "
                          f"margin {row['eval/margin']:.3f}")
            return
        row, self.initial = self.initial | row, {}
        self.last = row
        write_row(self.jsonl, self.mlflow, step, row)
        n = self.cfg.trainer.num_steps
        if (step + 1) % self.cfg.trainer.log_every == 0 or step + 1 == n:
            held = (f" | held-out accuracy {row['eval/accuracy']:.3f} margin {row['eval/margin']:.3f}"
                    if "eval/accuracy" in row else "")
            self._console(f"step {step + 1}/{n} loss {row['train/loss']:.4f} accuracy {row['train/accuracy']:.3f} "
                          f"margin {row['train/margin']:.3f} gnorm {row['train/grad_norm']:.3f} "
                          f"lr {row['train/lr']:.2e} | {row['time/step']:.2f}s{held}")

    def close(self, status: str = "FINISHED") -> None:
        """Close metrics.jsonl and end the mlflow run with ``status``: FINISHED after the last step, FAILED after an
        error, KILLED after a signal. Once: a second call does nothing."""
        if self.rank != 0 or self.jsonl is None:
            return
        self.jsonl.close()
        self.jsonl = None
        if self.mlflow is not None:
            mlflow, self.mlflow = self.mlflow, None
            end_mlflow_run(mlflow, self.run_id, status)
        if status != "FINISHED":  # the interrupt's or the error's own line says how the run ended
            return
        ckpt = self.cfg.checkpoint.dir
        export = (f"; export the newest: python -m megarl.convert mcore-to-hf --ckpt {ckpt}/$(cat {ckpt}/latest)/"
                  "reward_model --out RM_DIR" if ckpt and self.cfg.checkpoint.save_every else "")
        self._console(f"metrics: {self.out_dir / 'metrics.jsonl'}{export}")

    @staticmethod
    def _console(line: str) -> None:
        print(f"megarl: {line}", flush=True)
