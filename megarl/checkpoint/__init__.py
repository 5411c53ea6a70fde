"""Training checkpoints: atomic (a temporary directory renamed into place), resumable in any layout, exportable.

Layout of ``checkpoint.dir``:
  step_000012/actor/          megarl Megatron checkpoint of the actor (tp*_pp*.safetensors + config):
                              `python -m megarl.convert mcore-to-hf --ckpt .../actor --out HF_DIR`
  step_000012/actor/optimizer/tp{T}_pp{P}_dp{D}.safetensors
                              optimizer state in the same canonical TP/PP sharding as the weights:
                              fp32 master weights ("NAME/param") and Adam moments ("NAME/exp_avg",
                              "NAME/exp_avg_sq"), each the flat range [start, start + n) of the
                              parameter that DP rank D owns (metadata "offsets": name -> [start, *shape]);
                              with the distributed optimizer every DP rank writes its own range, without
                              it DP rank 0 writes whole parameters (and, with MoE experts over EP ranks,
                              DP ranks 1..EP-1 their experts)
  step_000012/actor/optimizer/common.pt   Adam step count, LR scheduler, loss scaler
  step_000012/actor/lora/rank{r}.safetensors
                              a LoRA actor's (actor.lora) adapters and their optimizer state, as rank r holds
                              them (resumable in any layout, megarl.lora.checkpoint); the actor's weights
                              beside them are the merged W + s B A, its base weights come from model.hf_path again
  step_000012/actor/lora/base_model.json
                              the base model's path and the size and CRC-32 of its weight files: a resume onto
                              other base weights is refused
  step_000012/critic/         same for the critic (PPO)
  step_000012/rank{r}.pt      this rank's RNG states
  step_000012/trainer.json    step, data position, KL controller, layout, the run's flattened config
  step_000012/manifest.json   size and CRC-32 of every other file (manifest.py)
  latest                      name of the newest complete checkpoint (replaced atomically)
  step_000005.damaged/        a checkpoint that failed verification, set aside by ``resume: auto``
A crash while saving leaves only a ``.step_*.tmp`` directory, which is never read; the previous checkpoint and
``latest`` stay as they were. One between the rename and ``latest``'s update leaves a complete checkpoint later than
``latest``: ``resume: auto`` names it and resumes from ``latest`` (later checkpoints are also what a run resumed
from an earlier one leaves), and a failure there says which to resume from. Every file is fsynced, then checksummed,
and the directories are fsynced before the rename. A resume first verifies the checkpoint (``verify``: each rank
checks its share of the bytes) and compares the experiment (resume_check.py). Resuming restores weights, optimizer
state, LR schedule and data position in any TP/PP/DP layout (and with or without the distributed optimizer): each
saved parameter is merged into its HF form and split again for the new layout (see mcore_ckpt.reshard), so the run
continues as an uninterrupted run in the new layout would, up to float rounding. The RNG states are restored only in
the same layout; elsewhere the ranks keep their fresh seeding (the RL loop draws its randomness from per-step
seeds).
"""

from megarl.checkpoint.paths import COMMON, LATEST, OPTIMIZER, TRAINER, checkpoints, rotate
from megarl.checkpoint.resuming import find, load, verify
from megarl.checkpoint.saving import save
from megarl.checkpoint.stop import acknowledge_stop, stop_file, stop_requested

__all__ = ["COMMON", "LATEST", "OPTIMIZER", "TRAINER", "acknowledge_stop", "checkpoints", "find", "load", "rotate",
           "save", "stop_file", "stop_requested", "verify"]
