"""Run tracking: per-step metrics to the console (rich), to metrics.jsonl, and to mlflow when enabled."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from megarl.config import Config
from megarl.errors import UserError


class Tracker:
    """Rank 0 logs; every rank times phases (the collective calls inside keep them in step)."""

    def __init__(self, cfg: Config, rank: int, out_dir: Path, start_step: int = 0) -> None:
        self.cfg, self.rank, self.start_step = cfg, rank, start_step
        self.times: dict[str, float] = {}
        self.history: list[dict[str, float]] = []
        self.mlflow: Any = None
        self.jsonl = None
        if rank != 0:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out_dir / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
        from rich.console import Console

        self.console = Console(stderr=True)
        if cfg.tracking.backend == "mlflow":
            try:
                import mlflow
            except ImportError:
                raise UserError("tracking.backend = mlflow but mlflow is not installed. Fix: `pip install "
                                "mlflow`, or set tracking.backend: none (metrics still go to metrics.jsonl).") from None
            mlflow.set_tracking_uri(cfg.tracking.uri)
            mlflow.set_experiment(cfg.tracking.experiment)
            mlflow.start_run(run_name=cfg.tracking.run_name)
            mlflow.log_params({k: str(v) for k, v in cfg.to_flat_dict().items()})
            self.mlflow = mlflow

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times[f"time/{name}"] = time.perf_counter() - start

    def log(self, step: int, batch: Any, metrics: dict[str, float]) -> None:
        tokens = sum(len(s) for s in batch.sequences)
        elapsed = sum(self.times.values())
        row = {"step": step, "reward_mean": float(batch.scores.mean()), "reward_std": float(batch.scores.std()),
               "response_length": float(batch.mask.sum(dim=1).mean()), "tokens_per_s": tokens / max(elapsed, 1e-9),
               **metrics, **self.times}
        self.history.append(row)
        if self.rank != 0:
            return
        assert self.jsonl is not None
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        if self.mlflow is not None:
            self.mlflow.log_metrics({k.replace("/", "_"): v for k, v in row.items() if k != "step"}, step=step)
        self.console.print(
            f"[bold]step {step + 1}/{self.cfg.trainer.num_steps}[/] reward {row['reward_mean']:.3f} "
            f"len {row['response_length']:.1f} kl {row.get('kl', 0.0):.4f} "
            f"clip {row.get('actor/clip_fraction', 0.0):.3f} gnorm {row.get('actor/grad_norm', 0.0):.3f} "
            f"lp-diff {row['logprob_diff_max']:.2e} | " + " ".join(
                f"{k[5:]} {v:.2f}s" for k, v in self.times.items()) + f" | {row['tokens_per_s']:.0f} tok/s")

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.mlflow is not None:
            self.mlflow.end_run()
