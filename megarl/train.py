"""Train a policy with GRPO or KL-PPO: `torchrun --nproc-per-node W megarl/train.py --config RECIPE [--set k=v ...]`."""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script (torchrun megarl/train.py): Python put megarl/ first on sys.path, where our
    # `platform` package would shadow the standard library's. Put the repository root there instead.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse  # noqa: E402

from megarl.run.command import end_finished_run, run_main  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megarl/train.py", description=__doc__)
    parser.add_argument("--config", required=True, help="recipe YAML (see docs/configuration.md)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    parser.add_argument("--profile", type=int, metavar="STEP",
                        help="write a torch profiler trace of step STEP (profile_stepSTEP_rankR.json in the run dir)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    from megarl.loop.bootstrap import setup

    cfg, trainer, loader, decode, tracker, evals = setup(args.config, args.set)
    from megarl import checkpoint
    from megarl.algos.correction import rollout_correction
    from megarl.algos.distill import reverse_kl_advantages
    from megarl.loop import samples
    from megarl.loop.rl_step import (
        actor_loss_mask,
        advantages_and_returns,
        check_drift,
        critic_loss_mask,
        logprob_drift,
        offpolicy_weights,
    )
    from megarl.run import startup
    from megarl.run.profiling import check_profile_step, profiled, trace_path

    algo = cfg.algorithm
    check_profile_step(args.profile, tracker.start_step, cfg.trainer.num_steps)
    if tracker.unlogged is not None:  # the run stopped in the evaluation after its checkpoint: finish that step
        step = tracker.start_step - 1
        with tracker.phase("eval"):  # the engines hold the checkpoint's weights, which that evaluation measures
            held_out = evals.run(trainer, decode, f"step_{step}") if tracker.unlogged["evaluate"] else {}
        evals.keep_best(step, held_out, saved=True)  # the checkpoint this run resumed from
        tracker.write(tracker.unlogged["row"] | trainer.step_metrics() | held_out)
    with tracker.phase("eval"):  # held-out accuracy of the starting weights, which the engines hold now
        held_out = evals.run(trainer, decode, "initial") if evals.before_train and tracker.start_step == 0 else {}
    startup.mark("resume and initial eval")
    for step in range(tracker.start_step, cfg.trainer.num_steps):
        with profiled(step == args.profile, trace_path(tracker.out_dir, step, trainer.groups.rank)):
            with tracker.phase("generate"):  # sample responses with the current policy and score them
                batch, sampling = trainer.generate(lambda: next(loader), step)
            with tracker.phase("reward_model"):  # reward_model.path: its score joins the rule reward
                sampling |= trainer.score_rewards(batch)
            with tracker.phase("score"):  # old logprobs: the trainer's view of the sampled tokens
                old = trainer.score(batch, trainer.actor)
            with tracker.phase("reference"):
                ref = trainer.score(batch, trainer.reference)
            with tracker.phase("critic"):  # values here, plus the critic's update below
                values = trainer.score(batch, trainer.critic)
            with tracker.phase("teacher"):  # on-policy distillation: the teacher's logprobs of the same tokens
                teacher = trainer.score(batch, trainer.teacher)
            drift = logprob_drift(batch, old)  # a broken weight hand-over shows as rollout/trainer disagreement
            check_drift(drift, cfg.rollout, step)
            # Importance weights pi_old / pi_rollout (truncated, or rejecting sequences): the engine's sampler is
            # not the trainer's. Async: the same weights correct the KL, distillation and entropy terms (offpolicy).
            is_weights, kept, correction = rollout_correction(old, batch.rollout_logprobs, batch.mask, algo)
            offpolicy = offpolicy_weights(batch, is_weights, kept)
            loss_mask = actor_loss_mask(batch, kept)
            advantages, returns, kl_metrics = advantages_and_returns(
                batch, algo, cfg.rollout.num_samples_per_prompt, trainer.kl.value, ref, old, values,
                cfg.response_budget(), offpolicy=offpolicy, loss_mask=loss_mask)
            distill: dict[str, float] = {}
            if teacher is not None:  # each token's reverse KL to the teacher: its own negative advantage (or a loss)
                distilled, distill = reverse_kl_advantages(old, teacher, batch.mask, cfg.distill.coef, offpolicy)
                distill["distill/top1_agreement"] = trainer.top1_agreement(batch)
                if cfg.distill.form == "advantage":
                    advantages = advantages + distilled
            samples.write(cfg, tracker.out_dir, trainer.groups.rank, step, batch, decode, advantages)  # log_samples
            extras = {"old_logprobs": old, "advantages": advantages}
            if teacher is not None and cfg.distill.form == "loss":
                extras["teacher_logprobs"] = teacher
            if ref is not None:
                extras["ref_logprobs"] = ref
            if algo.rollout_correction != "none":
                extras["is_weights"] = is_weights
            if offpolicy is not None:
                extras["offpolicy_weights"] = offpolicy[0]
            with tracker.phase("update"):  # clipped policy updates, epochs x shuffled mini-batches
                metrics = trainer.update_actor(batch, extras, step, loss_mask)
            with tracker.phase("critic"):
                if values is not None and returns is not None:
                    metrics |= trainer.update_critic(batch, {"old_values": values, "returns": returns}, step,
                                                     critic_loss_mask(batch, kept))
            if "kl" in kl_metrics:
                trainer.kl.update(kl_metrics["kl"], len(batch.sequences))
            every, last = cfg.checkpoint.save_every, step + 1 == cfg.trainer.num_steps
            stop = checkpoint.stop_requested(cfg.checkpoint, trainer.groups.device)  # Slurm: time limit, preemption
            evaluate = evals.due(step) and not stop
            correction = {f"rollout_correction/{k}": v for k, v in correction.items()}
            trained = (metrics | drift | kl_metrics | distill | sampling | correction | {"kl_coef": trainer.kl.value}
                       | held_out)
            saved = stop or bool(every and ((step + 1) % every == 0 or last))
            if saved:  # atomic: a crash mid-save keeps the last one
                # The step's row goes with its checkpoint: a run stopped before the row is logged (in the
                # evaluation below, by a signal or an error) finishes and logs it when it resumes.
                state = trainer.rollout.snapshot(loader) | {  # the data cursor and the samples in flight
                         "kl": trainer.kl.state_dict(), "tracking": tracker.state_dict(),
                         "reward_model": trainer.reward_model.state_dict() if trainer.reward_model else None,
                         "config": cfg.to_flat_dict(), "teacher": trainer.teacher_files,  # a resume compares them
                         "reference": trainer.reference_files,
                         "unlogged": {"row": tracker.row(step, batch, trained), "evaluate": evaluate}}
                with tracker.phase("checkpoint"):  # while the engine sleeps
                    checkpoint.save(cfg.checkpoint.dir, step, trainer.trained_models(), state,
                                    cfg.checkpoint.keep_last, prepare=trainer.hold_for_checkpoint)
            if not (stop or last) or evaluate:
                with tracker.phase("reshard"):  # new weights into the engine's layout, in place
                    trainer.push_weights()
            with tracker.phase("eval"):  # the weights the engines just received, on the held-out sets
                held_out = evals.run(trainer, decode, f"step_{step}") if evaluate else {}
            evals.keep_best(step, held_out, saved)
            tracker.log(step, batch, trained | trainer.step_metrics() | held_out
                        | startup.step_ended(tracker.last["eval"] if evaluate else 0.0))
            held_out = {}
            if stop:
                checkpoint.acknowledge_stop(cfg.checkpoint, step)
                break
    tracker.close()
    trainer.close()
    from megarl.distributed.parallel import shutdown_distributed

    shutdown_distributed()
    if trainer.groups.rank == 0 and tracker.history:
        from megarl.report import report

        print(report(tracker.out_dir), flush=True)
    end_finished_run()


if __name__ == "__main__":
    run_main(main)
