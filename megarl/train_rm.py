"""Train a reward model on preference pairs (Bradley-Terry):
`torchrun --nproc-per-node W -m megarl.train_rm --config RECIPE [--set k=v ...]` (docs/reward_models.md)."""

from __future__ import annotations

import argparse
import os
import time

from megarl.run.command import run_main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megarl.train_rm", description=__doc__)
    parser.add_argument("--config", required=True, help="reward-model recipe YAML (docs/reward_models.md)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from megarl.loop.bootstrap import quiet_expected_warnings, standalone_env
    from megarl.rm.setup import prepare
    from megarl.run import interrupt

    quiet_expected_warnings()
    standalone_env()
    interrupt.install()  # SIGTERM (scancel, a time limit) and SIGHUP end the run as Ctrl-C does: one line, 128 + signal
    run = prepare(args.config, args.set, int(os.environ["WORLD_SIZE"]))
    from megarl import checkpoint
    from megarl.data.loader import PromptLoader
    from megarl.distributed.parallel import shutdown_distributed
    from megarl.rm.setup import start
    from megarl.rm.trainer import RewardTrainer

    cfg, groups, log = start(run)
    trainer = RewardTrainer(cfg, groups, run.spec, run.from_reward_model)
    loader = PromptLoader(run.train, cfg.data.pairs_per_step, cfg.data.shuffle, cfg.data.seed,
                          key=lambda p: [p.chosen, p.rejected])
    models = {"reward_model": trainer.model}
    first = 0
    found = checkpoint.find(cfg.checkpoint.resume, cfg.checkpoint.dir)
    if found is not None:
        run.check_unchanged(found)
        state = checkpoint.load(found, models)
        loader.load_state_dict(state["loader"])
        first = state["step"] + 1
        log.resumed(found, first, state.get("mlflow_run_id"))
    log.open(first)
    run.hand_over()  # the log's mlflow run (if any) now records how the run ends
    every = cfg.trainer.eval_every
    if run.held_out and every and first == 0:
        log.write(-1, {f"eval/{k}": v for k, v in trainer.evaluate(run.held_out).items()})
    for step in range(first, cfg.trainer.num_steps):
        started = time.perf_counter()
        row = {f"train/{k}": v for k, v in trainer.step(next(loader), step).items()}
        last = step + 1 == cfg.trainer.num_steps
        if run.held_out and every and ((step + 1) % every == 0 or last):
            row |= {f"eval/{k}": v for k, v in trainer.evaluate(run.held_out).items()}
        row["time/step"] = time.perf_counter() - started
        # The row before its checkpoint: a signal after the save would lose it for good (the resume starts after
        # it), while a resume from an earlier checkpoint logs its steps again (forget_jsonl_steps).
        log.write(step, row)
        saves = cfg.checkpoint.save_every
        stop = checkpoint.stop_requested(cfg.checkpoint, groups.device)  # Slurm: time limit, preemption
        if stop or (saves and ((step + 1) % saves == 0 or last)):
            checkpoint.save(cfg.checkpoint.dir or "", step, models,
                            {"loader": loader.state_dict(), "config": cfg.to_flat_dict(), "mlflow_run_id": log.run_id},
                            cfg.checkpoint.keep_last)
        if stop:
            checkpoint.acknowledge_stop(cfg.checkpoint, step)
            break
    log.close()
    shutdown_distributed()


if __name__ == "__main__":
    run_main(main)
