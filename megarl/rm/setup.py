"""Start-up of reward-model training: everything checked before a process group exists (config, model, layout,
pairs), then the process groups, the run directory's lock and the metrics log."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megarl.checkpoint.schedule_change import resized_schedule
from megarl.config.reward_training import RewardTrainingConfig, load_reward_training
from megarl.config.yaml_io import check
from megarl.distributed.parallel import ParallelGroups
from megarl.errors import UserError
from megarl.models.spec import ModelSpec
from megarl.rm.pairs import TokenizedPair

DEFINING = ("model.hf_path", "model.dtype", "data.train_path", "data.pairs_per_step", "data.apply_chat_template",
            "data.end_with_eos",
            "data.max_tokens", "data.drop_long", "data.shuffle", "data.seed", "training.optimizer.", "trainer.seed")
"""Keys (or prefixes) a resume must not change: they define what the checkpoint's steps trained."""


@dataclass(kw_only=True)
class Prepared:
    cfg: RewardTrainingConfig
    spec: ModelSpec
    from_reward_model: bool
    train: list[TokenizedPair]
    held_out: list[TokenizedPair]
    dp: int
    out_dir: Path
    hand_over: Callable[[], None]
    """Called once the metrics log's mlflow run has started: until then an error or a signal records a FAILED or
    KILLED mlflow run of its own (megarl.run.tracking.record_if_it_ends), as train.py's start-up does."""

    def check_unchanged(self, path: Path) -> None:
        """Refuse a resume whose recipe changes what the checkpoint at ``path`` trained, naming each key."""
        state = json.loads((path / "trainer.json").read_text())
        saved, now = state.get("config", {}), self.cfg.to_flat_dict()
        changed = [k for k in now if k.startswith(DEFINING) and k in saved and saved[k] != now[k]]
        if changed:
            raise UserError(f"checkpoint {path} was trained with "
                            + ", ".join(f"{k} = {saved[k]!r}" for k in changed) + "; this recipe has "
                            + ", ".join(f"{now[k]!r}" for k in changed) + ". Fix: restore them, or start anew "
                            "(another checkpoint.dir with checkpoint.resume: none).")
        optim = self.cfg.training.optimizer  # its fields cannot change on a resume (DEFINING)
        resized = resized_schedule({"training.optimizer": (optim, optim)},
                                   saved.get("trainer.num_steps"), self.cfg.trainer.num_steps, state.get("step"))
        if resized and dist.get_rank() == 0:
            print(resized, flush=True)


def check_layout(cfg: RewardTrainingConfig, spec: ModelSpec, world: int) -> int:
    """The data-parallel size of the trainer's layout on ``world`` ranks, after checking it fits the model."""
    p = cfg.parallel
    tp, pp = p.tensor_parallel, p.pipeline_parallel
    check(world % (tp * pp) == 0, "parallel.tensor_parallel", tp,
          f"divide the {world} ranks with parallel.pipeline_parallel ({pp}): TP x PP must divide them",
          "choose sizes whose product divides the ranks")
    for name, count in (("num_attention_heads", spec.num_attention_heads), ("num_key_value_heads", spec.num_kv_heads),
                        ("MLP width", spec.ffn_size(spec.is_moe))):
        check(count % tp == 0, "parallel.tensor_parallel", tp, f"divide the model's {name} ({count})",
              "use a divisor of it")
    stages = pp * (p.virtual_pipeline or 1)
    check(spec.num_layers % stages == 0, "parallel.pipeline_parallel", pp,
          f"(times virtual_pipeline) divide the model's {spec.num_layers} layers", "use a divisor of them")
    check(p.expert_parallel == 1, "parallel.expert_parallel", p.expert_parallel,
          "be 1 in reward-model training", "set parallel.expert_parallel: 1")
    dp = world // (tp * pp)
    check(p.data_parallel in (None, dp), "parallel.data_parallel", p.data_parallel,
          f"be {dp} (the {world} ranks over TP {tp} x PP {pp}) or null", f"set it to {dp} or null")
    check(2 * cfg.data.pairs_per_step >= dp, "data.pairs_per_step", cfg.data.pairs_per_step,
          f"give every one of the {dp} data-parallel replicas a conversation (2 per pair)",
          f"use at least {(dp + 1) // 2}")
    return dp


def prepare(config: str, overrides: Sequence[str], world: int) -> Prepared:
    """Everything that can be checked before the process groups: config, model, layout, tokenizer and pairs."""
    from megarl.data.preferences import load_pairs
    from megarl.data.tokenizer import load_tokenizer
    from megarl.models.reward_model import load_body_spec, pad_token_id
    from megarl.rm.pairs import pad_end_note, tokenize_pairs
    from megarl.run.tracking import record_if_it_ends

    cfg = load_reward_training(config, overrides)
    out_dir = Path(cfg.checkpoint.dir or "runs/latest_rm")
    hand_over = record_if_it_ends(cfg, out_dir)  # bad pairs or a refused layout still leave an mlflow run
    spec, from_reward_model = load_body_spec(cfg.model.hf_path, "model.hf_path")
    dp = check_layout(cfg, spec, world)
    check(cfg.data.max_tokens <= spec.max_position_embeddings, "data.max_tokens", cfg.data.max_tokens,
          f"be at most the model's context, max_position_embeddings = {spec.max_position_embeddings} "
          f"({cfg.model.hf_path}): longer conversations would be scored past the positions it was trained on, and "
          "nothing would fail", f"set data.max_tokens: {spec.max_position_embeddings} or less")
    t, p = cfg.training, cfg.parallel
    # A conversation trains with one token more than it is scored on (megarl.rm.trainer), its row rounded up to the
    # TP ranks under sequence parallelism: the longest the data allows must fit a micro-batch, or a step fails hours
    # in, on the first batch that draws one.
    multiple = p.tensor_parallel if p.sequence_parallel else 1
    longest = -(-(cfg.data.max_tokens + 1) // multiple) * multiple
    check(not t.dynamic_batch or longest <= t.max_tokens_per_gpu, "training.max_tokens_per_gpu", t.max_tokens_per_gpu,
          f"hold the longest conversation data.max_tokens = {cfg.data.max_tokens} allows, trained with one token "
          f"more ({longest} token slots)", f"set training.max_tokens_per_gpu: {longest} or more, or lower "
          "data.max_tokens")
    tokenizer = load_tokenizer(cfg.model.hf_path)
    d = cfg.data
    train, dropped = tokenize_pairs(load_pairs(d.train_path, "data.train_path"), tokenizer, d.apply_chat_template,
                                    d.end_with_eos, d.max_tokens, d.drop_long, spec.vocab_size, "data.train_path")
    check(d.pairs_per_step <= len(train), "data.pairs_per_step", d.pairs_per_step,
          f"be at most the {len(train)} training pairs", "lower it, or give more pairs")
    held_out: list[TokenizedPair] = []
    if d.eval_path is not None:
        held_out, _ = tokenize_pairs(load_pairs(d.eval_path, "data.eval_path"), tokenizer, d.apply_chat_template,
                                     d.end_with_eos, d.max_tokens, d.drop_long, spec.vocab_size, "data.eval_path")
        held_out = held_out[:d.max_eval_pairs]
    if int(os.environ.get("RANK", "0")) == 0:
        skipped = f" ({dropped} longer than data.max_tokens skipped)" if dropped else ""
        print(f"megarl: {len(train)} training pairs{skipped}, {len(held_out)} held out; "
              f"{'a reward model' if from_reward_model else 'a causal LM with a new scalar head'} from "
              f"{cfg.model.hf_path}; TP={cfg.parallel.tensor_parallel} PP={cfg.parallel.pipeline_parallel} DP={dp}",
              flush=True)
        if (note := pad_end_note(tokenizer, pad_token_id(spec), d.end_with_eos)) is not None:
            print(note, flush=True)
    return Prepared(cfg=cfg, spec=spec, from_reward_model=from_reward_model, train=train, held_out=held_out, dp=dp,
                    out_dir=out_dir, hand_over=hand_over)


def start(run: Prepared) -> tuple[RewardTrainingConfig, ParallelGroups, Any]:
    """The process groups, the run directory locked, and the metrics log."""
    from megarl.distributed.parallel import ParallelDims, init_distributed, init_model_parallel, model_parallel_seed
    from megarl.loop.bootstrap import check_writable
    from megarl.platform import init_platform
    from megarl.rm.log import RewardLog
    from megarl.run.lock import lock_run

    cfg = run.cfg
    platform = init_platform()
    p = cfg.parallel
    init_distributed(platform, p.timeout_minutes)
    out_dir = run.out_dir
    field = "checkpoint.dir" if cfg.checkpoint.dir else "the default run directory (checkpoint.dir)"
    check_writable(out_dir, field)
    lock_run(out_dir, field, platform.device)
    groups = init_model_parallel(ParallelDims(tp=p.tensor_parallel, pp=p.pipeline_parallel, dp=run.dp,
                                              vpp=p.virtual_pipeline, order=p.rank_order), p.timeout_minutes)
    model_parallel_seed(cfg.trainer.seed)
    return cfg, groups, RewardLog(cfg, out_dir, groups.rank)
