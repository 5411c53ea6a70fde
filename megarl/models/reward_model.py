"""A learned reward model (reward_model.path): a HF `*ForSequenceClassification` with one label, built as a frozen
Megatron GPTModel whose output layer is a scalar head (the critic's ValueHead) holding the checkpoint's
``score.weight`` [1, hidden], in the trainer's TP/PP layout.

transformers scores a sequence at its last token that is not the pad token (the rightmost one, so left and right
padding both work); megarl's sequences carry no padding, so each is scored at its last token after trailing pad
tokens are dropped, which is the same position (attention is causal: tokens after it change nothing before it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megarl.distributed.parallel import ParallelGroups
from megarl.errors import UserError
from megarl.models.forward import forward_only
from megarl.models.gpt import BuildOptions, load_weights
from megarl.models.hf_io import HFReader
from megarl.models.mapping import hf_shapes
from megarl.models.reward_format import HEAD, SEQUENCE_CLASSIFICATION, num_labels
from megarl.models.spec import (
    SUPPORTED_ARCHITECTURES,
    ModelSpec,
    architectures,
    damaged_values,
    load_spec,
    read_config,
    spec_from_config,
)
from megarl.models.trainable import MegatronModel

FIELD = "reward_model.path"


def load_reward_spec(hf_dir: str, field: str = FIELD) -> ModelSpec:
    """The body's spec of a reward model directory, after refusing another architecture or more than one label."""
    path = Path(hf_dir) / "config.json"
    try:
        with damaged_values(path):
            return _reward_spec(read_config(hf_dir), path)
    except UserError as err:
        raise UserError(f"{field} = {hf_dir!r}: {err}") from None


def _reward_spec(cfg: dict[str, Any], path: Path) -> ModelSpec:
    archs = architectures(cfg, path, SEQUENCE_CLASSIFICATION)
    arch = next((a for a in archs if a in SEQUENCE_CLASSIFICATION), None)
    if arch is None:
        causal = " (a causal LM: its head predicts tokens, not a reward)" if any(
            a in SUPPORTED_ARCHITECTURES for a in archs) else ""
        raise UserError(f"architecture {archs}{causal} is not a "
                        f"reward model megarl loads; it loads {sorted(SEQUENCE_CLASSIFICATION)} with num_labels 1. "
                        "Fix: point it at such a directory (Skywork-Reward's format), or save yours with "
                        "transformers' AutoModelForSequenceClassification (num_labels=1).")
    labels = num_labels(cfg)
    if labels != 1:
        raise UserError(f"{arch} has num_labels = {labels} (id2label "
                        f"{cfg.get('id2label')}) but a reward model has 1: one scalar per sample. Fix: use a reward "
                        "model with one label (score.weight of shape [1, hidden_size]).")
    return spec_from_config(cfg | {"architectures": [SEQUENCE_CLASSIFICATION[arch]]}, path)


def load_body_spec(hf_dir: str, field: str) -> tuple[ModelSpec, bool]:
    """The body's spec of ``hf_dir`` and whether it is a reward model (its body and head), else a causal LM (its
    body, under a head of the caller's); errors name ``field``, the config key that gave the directory."""
    try:
        archs = read_config(hf_dir).get("architectures")
    except UserError as err:
        raise UserError(f"{field} = {hf_dir!r}: {err}") from None
    # A bare string still tells which kind of model it is, so that the refusal suggests its own class.
    listed = archs if isinstance(archs, list) else [archs]
    if any(isinstance(a, str) and a in SEQUENCE_CLASSIFICATION for a in listed):
        return load_reward_spec(hf_dir, field), True
    return load_spec(hf_dir, field), False


def pad_token_id(spec: ModelSpec) -> int | None:
    """The pad token transformers' sequence classification skips at the end of a sequence (None: none)."""
    pad = spec.hf_config.get("pad_token_id")
    return int(pad) if isinstance(pad, int) else None


def last_position(sequence: Sequence[int], pad: int | None) -> int:
    """Where transformers reads a sequence's score: its rightmost token that is not ``pad`` (0 if all are)."""
    if pad is None:
        return len(sequence) - 1
    for i in range(len(sequence) - 1, -1, -1):
        if sequence[i] != pad:
            return i
    return 0


@dataclass(frozen=True, slots=True)
class RewardModelCheck:
    """What start-up found of a reward model: its spec, its tokenizer, and whether it reads the policy's token
    ids as they are."""

    spec: ModelSpec
    tokenizer: Any
    shares_tokens: bool
    """Same vocabulary and chat template as the policy's: its token ids are the reward model's input as they are.
    Otherwise each conversation is rendered again with the reward model's tokenizer and chat template."""


def check_reward_model(rm_dir: str, policy_dir: str, policy_tokenizer: Any, policy: ModelSpec) -> RewardModelCheck:
    """At start-up, before anything is built: the reward model's architecture, labels, head and vocabulary, each
    mismatch an error naming both sides."""
    from megarl.data.tokenizer import load_tokenizer

    spec = load_reward_spec(rm_dir)
    open_weights(spec, rm_dir)  # the head and every tensor against config.json
    tokenizer = load_tokenizer(rm_dir, FIELD)
    shares = (tokenizer.get_vocab() == policy_tokenizer.get_vocab()
              and tokenizer.chat_template == policy_tokenizer.chat_template)
    if shares and spec.vocab_size < policy.vocab_size:
        raise UserError(f"{FIELD} = {rm_dir!r} has {spec.vocab_size} embedding rows (vocab_size in its config.json), "
                        f"fewer than the {policy.vocab_size} of model.hf_path = {policy_dir!r}, whose tokenizer it "
                        "shares: the policy can sample ids the reward model has no embedding for. Fix: use a reward "
                        "model whose vocab_size is at least the policy's (the same family).")
    largest = max(len(tokenizer) - 1, *tokenizer.get_vocab().values())  # added tokens included
    if not shares and largest >= spec.vocab_size:
        raise UserError(f"{FIELD} = {rm_dir!r}: its tokenizer has ids up to {largest} but its embedding has "
                        f"{spec.vocab_size} rows (vocab_size in its config.json): the conversations it renders "
                        "could hold ids past them. Fix: copy the tokenizer files of the reward model's own release "
                        "into that directory.")
    return RewardModelCheck(spec, tokenizer, shares)


def open_weights(spec: ModelSpec, rm_dir: str, field: str = FIELD) -> HFReader:
    """The reward model's tensors, each checked against the shape config.json implies: the body's (no LM head) and
    the head ``score.weight`` [1, hidden_size]; a tensor of another shape is an error naming both and ``field``."""
    shapes = {k: v for k, v in hf_shapes(spec).items() if k != "lm_head.weight"} | {HEAD: (1, spec.hidden_size)}
    try:
        return HFReader(rm_dir, spec, shapes)
    except UserError as err:
        raise UserError(f"{field} = {rm_dir!r}: {err}") from None


def load_reward_weights(chunks: list[torch.nn.Module], spec: ModelSpec, hf_dir: str, groups: ParallelGroups,
                        opts: BuildOptions, field: str = FIELD) -> None:
    """A reward model directory's body and head (``score.weight``, into the critic's ValueHead) into ``chunks``, a
    critic-shaped model in the trainer's layout (MegatronModel's ``load``); ``field`` gave the directory."""
    reader = open_weights(spec, hf_dir, field)
    load_weights(chunks, spec, reader.read, groups, opts)
    if groups.is_last_stage:
        head: Any = chunks[-1].output_layer  # the critic's ValueHead
        with torch.no_grad():
            head.weight.copy_(reader.read(HEAD, None, 0, 0).to(head.weight.dtype))


@torch.no_grad()
def score_sequences(model: MegatronModel, groups: ParallelGroups, sequences: Sequence[Sequence[int]],
                    pad: int | None, max_tokens: int | None = None, micro_batch_size: int = 1) -> list[float] | None:
    """One score per sequence from a critic-shaped ``model``, read at its last token that is not ``pad`` (as
    transformers does), on the last pipeline stage; None elsewhere. Every rank of a pipeline passes the same
    ``sequences``."""
    assert all(len(s) >= 1 for s in sequences), "every sequence needs a token"
    trimmed = [list(s[: last_position(s, pad) + 1]) for s in sequences]
    batches = model._micro_batches(trimmed, max_tokens, micro_batch_size)
    outputs = forward_only(model.chunks, groups, batches, lambda tokens, out: out[..., 0].float(),
                           thd=model.packing == "thd")
    if outputs is None:
        return None
    scores: dict[int, float] = {}
    for batch, out in zip(batches, outputs, strict=True):
        for i, row, start, n in batch.spans:
            scores[i] = float(out[row, start + n - 1])
    return [scores[i] for i in range(len(sequences))]


def scores_on_every_rank(score: Callable[[list[list[int]]], list[float] | None], sequences: Sequence[Sequence[int]],
                         groups: ParallelGroups) -> torch.Tensor:
    """[N] scores of ``sequences`` on every rank: each data-parallel replica scores its share with ``score`` (whose
    result its last pipeline stage holds), then the replicas' shares are summed and the last stage's broadcast."""
    import torch.distributed as dist

    mine = list(range(groups.dp_rank, len(sequences), groups.dims.dp))
    scores = score([list(sequences[i]) for i in mine]) if mine else None
    out = torch.zeros(len(sequences), dtype=torch.float32)
    if scores is not None:
        out[mine] = torch.tensor(scores, dtype=torch.float32)
    out = out.to(groups.device)  # NCCL takes CUDA tensors only
    if groups.dims.dp > 1:
        dist.all_reduce(out, group=groups.dp_group)  # replicas hold disjoint samples
    if groups.dims.pp > 1:
        dist.broadcast(out, src=dist.get_global_rank(groups.pp_group, groups.dims.pp - 1), group=groups.pp_group)
    return out.cpu()


class RewardModel:
    """A frozen reward model in the trainer's layout: ``score`` gives each sequence's scalar reward."""

    def __init__(self, spec: ModelSpec, hf_dir: str, groups: ParallelGroups, opts: BuildOptions) -> None:
        self.spec, self.groups, self.hf_dir = spec, groups, hf_dir
        opts = dataclasses.replace(opts, critic=True, logprob_chunk_tokens=0)
        self.model = MegatronModel(spec, None, groups, opts,  # frozen: no optimizer
                                   load=lambda chunks: load_reward_weights(chunks, spec, hf_dir, groups, opts))
        self.pad = pad_token_id(spec)

    def score(self, sequences: Sequence[Sequence[int]], max_tokens: int | None = None,
              micro_batch_size: int = 1) -> list[float] | None:
        """One reward per sequence (``score_sequences``) on the last pipeline stage; None elsewhere."""
        return score_sequences(self.model, self.groups, sequences, self.pad, max_tokens, micro_batch_size)
