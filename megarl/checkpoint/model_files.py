"""One model's files in a checkpoint, from and into the state it hands over (megarl.models.state.ModelState): its
weights as the megarl Megatron checkpoint (megarl.models.mcore_ckpt), its optimizer's state in the same canonical
TP/PP sharding, and the parts it keeps beside them (each writes its own). Loading reshards all of it into the
current layout."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from megarl.checkpoint.paths import COMMON, OPTIMIZER
from megarl.errors import UserError
from megarl.models.hf_io import copy_model_files
from megarl.models.mcore_ckpt import FORMAT, META, VERSION, read_meta, reshard, saved_shards, shard_file
from megarl.models.optimizer_state import STATE_KEYS, flat_state, saved_state
from megarl.models.spec import ModelSpec, load_spec
from megarl.models.state import ModelState, Stateful


def model_states(models: Mapping[str, Stateful], prepare: Callable[[str], None] | None
                 ) -> Iterator[tuple[str, ModelState]]:
    """Each model's state, one at a time, after ``prepare(role)`` brought the model onto the device (its tensors
    are read or written before the next one's turn)."""
    for role, model in models.items():
        if prepare is not None:
            prepare(role)
        yield role, model.state()


def save_model(state: ModelState, out: Path) -> list[Path]:
    """Every rank: its share of the model's weights, optimizer state and parts into ``out``; the files it wrote (rank
    0's small files unnamed: the checkpoint lists them at publishing)."""
    written = _save_weights(state, out)
    if state.optimizer is not None:
        written += _save_optimizer(state, out / OPTIMIZER)
    for part in state.parts:
        written += part.save(out, state)
    return written


def load_model(state: ModelState, ckpt: Path) -> None:
    """Restore ``state``'s tensors in place from the model directory ``ckpt``, in any layout."""
    meta = check_compatible(ckpt, state)
    _load_weights(ckpt, meta, state)
    if state.optimizer is not None:
        _load_optimizer(ckpt, meta, state)
    for part in state.parts:
        part.load(ckpt, state)


def _saving(state: ModelState, whole: bool) -> dict[str, torch.Tensor] | None:
    """The weights (None: none) this rank writes: the first DP replica of a (TP, PP) position writes its shard, and
    with experts split over expert-parallel ranks the first replica of each other EP rank writes its experts.
    ``whole``: every DP rank writes (its own ranges, the distributed optimizer's way)."""
    g = state.groups
    if whole or g.dp_rank == 0:
        return state.weights
    if g.dp_rank < g.dims.ep:  # DP ranks 1..ep-1 are the first replicas of the other expert-parallel ranks
        return {n: t for n, t in state.weights.items() if ".mlp.experts." in n}
    return None


def _save_weights(state: ModelState, out: Path) -> list[Path]:
    """The canonical shard of this (TP, PP) position, written by its first DP replica (other expert-parallel ranks'
    experts: by theirs, in files of their own)."""
    g = state.groups
    params = _saving(state, whole=False)
    written = []
    if params is not None:
        tensors = {n: t.detach().cpu().contiguous() for n, t in params.items()}
        ep_rank = g.dp_rank  # 0, or the expert-parallel rank of an experts-only writer
        written.append(out / shard_file(g.tp_rank, g.pp_rank, ep_rank))
        save_file(tensors, str(written[-1]), metadata={"format": FORMAT})
    if g.rank == 0:
        (out / META).write_text(json.dumps({"format": FORMAT, "version": VERSION, "tp": g.dims.tp, "pp": g.dims.pp,
                                            "ep": g.dims.ep, "vocab_pad_multiple": state.vocab_pad_multiple,
                                            "padded_vocab_size": state.padded_vocab_size, "critic": state.critic}))
        if state.hf_dir is not None:  # the tokenizer and generation config: exports load as they are
            copy_model_files(Path(state.hf_dir), out)
        (out / "config.json").write_text(json.dumps(state.spec.hf_config, indent=2) + "\n")
    return written


def _save_optimizer(state: ModelState, out: Path) -> list[Path]:
    """This rank's range of the optimizer state (every DP rank with the distributed optimizer, else the writers of
    the weights), and rank 0's common part (step count, LR schedule, loss scaler)."""
    assert state.optimizer is not None
    g = state.groups
    params = _saving(state, whole=state.optimizer.distributed)
    written = []
    if params is not None:
        tensors, offsets = flat_state(state.optimizer.slots(), {n: t.shape for n, t in params.items()})
        written.append(out / f"tp{g.tp_rank:02d}_pp{g.pp_rank:02d}_dp{g.dp_rank:02d}.safetensors")
        save_file(tensors, str(written[-1]),
                  metadata={"format": FORMAT, "tp_rank": str(g.tp_rank), "offsets": json.dumps(offsets)})
    if g.rank == 0:
        torch.save(state.optimizer.common(), out / COMMON)
    return written


def check_compatible(ckpt: Path, state: ModelState) -> dict[str, int]:
    """The checkpoint's meta, once it is known to hold this model's role and architecture."""
    meta = read_meta(ckpt)
    saved = load_spec(ckpt)
    for field in dataclasses.fields(ModelSpec):
        ours, theirs = getattr(state.spec, field.name), getattr(saved, field.name)
        if field.name != "hf_config" and ours != theirs:
            raise UserError(f"{ckpt} holds another model: its {field.name} is {theirs!r}, the model being trained "
                            f"(model.hf_path) has {ours!r}. Set model.hf_path to the model the checkpoint was "
                            "trained from, resume another checkpoint, or start a new run in another checkpoint.dir.")
    if bool(meta.get("critic")) != state.critic:
        raise UserError(f"{ckpt / META} has critic = {bool(meta.get('critic'))}, but it is loaded into a model with "
                        f"critic = {state.critic}. Point checkpoint.resume at a checkpoint of this algorithm.")
    if not (ckpt / OPTIMIZER / COMMON).is_file():
        raise UserError(f"{ckpt} has no {OPTIMIZER}/{COMMON}: it was written by an older megarl or is damaged. "
                        "Resume from another step_* directory, or start anew in another checkpoint.dir.")
    return meta


@torch.no_grad()
def _load_weights(ckpt: Path, meta: dict[str, int], state: ModelState) -> None:
    g = state.groups
    for name, shard in reshard(state.spec, saved_shards(ckpt), meta, state.weights, g.tp_rank, g.dims.tp,
                               state.padded_vocab_size, state.critic):
        state.weights[name].copy_(shard)


@torch.no_grad()
def _load_optimizer(ckpt: Path, meta: dict[str, int], state: ModelState) -> None:
    assert state.optimizer is not None
    g = state.groups
    state.optimizer.allocate()
    slots = state.optimizer.slots()
    saved = saved_state(ckpt / OPTIMIZER)
    for key in STATE_KEYS:
        for name, full in reshard(state.spec, saved(key), meta, slots, g.tp_rank, g.dims.tp,
                                  state.padded_vocab_size, state.critic):
            start, live = slots[name]
            live[key].copy_(full.reshape(-1)[start: start + live[key].numel()].view_as(live[key]))
    state.optimizer.load_common(torch.load(ckpt / OPTIMIZER / COMMON, weights_only=False))
