"""megarl's Megatron checkpoint: one safetensors file per (TP, PP) shard, canonical names, atomic writes.

Layout of a checkpoint directory:
  megarl_checkpoint.json     format, version, tp, pp, vocab_pad_multiple, padded_vocab_size
  config.json + tokenizer    the HF files of the source model, so export needs nothing else
  tp{T:02d}_pp{P:02d}.safetensors  that shard's parameters by canonical Megatron name (global layer index)
  tp{T:02d}_pp{P:02d}_ep{E:02d}.safetensors  with MoE experts split over expert-parallel ranks (training only):
                             the experts of expert-parallel rank E >= 1 (global expert index); rank 0's are
                             in the file above
Any TP/PP(/EP) layout loads it (``reshard``): each parameter's TP shards are merged into its HF tensors
and split again, and names are found in whichever PP file holds them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megarl.errors import UserError
from megarl.models.hf_io import HFReader, atomic_dir, copy_model_files
from megarl.models.mapping import VOCAB, ParamRule, hf_shapes, param_rules, pipeline_stage, to_hf, to_mcore_shard
from megarl.models.reward_format import HEAD, reward_config
from megarl.models.spec import ModelSpec, load_spec

META = "megarl_checkpoint.json"
FORMAT, VERSION = "megarl-mcore", 1


def shard_file(tp_rank: int, pp_rank: int, ep_rank: int = 0) -> str:
    return f"tp{tp_rank:02d}_pp{pp_rank:02d}{f'_ep{ep_rank:02d}' if ep_rank else ''}.safetensors"


def check_layout(spec: ModelSpec, tp: int, pp: int, tp_flag: str = "--tp", pp_flag: str = "--pp") -> None:
    if tp < 1 or spec.num_kv_heads % tp:
        raise UserError(f"{tp_flag} {tp} must divide num_key_value_heads={spec.num_kv_heads} (Megatron splits "
                        f"whole query groups over TP); use one of {_divisors(spec.num_kv_heads)}.")
    ffn = spec.ffn_size(spec.is_moe)
    if spec.num_attention_heads % tp or ffn % tp:
        fits = [d for d in _divisors(spec.num_kv_heads) if spec.num_attention_heads % d == 0 and ffn % d == 0]
        raise UserError(f"{tp_flag} {tp} must divide num_attention_heads={spec.num_attention_heads} and the MLP width "
                        f"{ffn} (Megatron splits both over TP); use one of {fits}.")
    if pp < 1 or spec.num_layers % pp:
        raise UserError(f"{pp_flag} {pp} must divide num_hidden_layers={spec.num_layers}; use one of "
                        f"{_divisors(spec.num_layers)}.")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, tp: int, pp: int, vocab_pad_multiple: int = 128,
                log: bool = False) -> None:
    """Convert a HF checkpoint to megarl's Megatron layout; writes to a temporary dir, then renames."""
    spec = load_spec(hf_dir)
    check_layout(spec, tp, pp)
    reader = HFReader(hf_dir, spec, hf_shapes(spec))
    padded = spec.padded_vocab_size(tp, vocab_pad_multiple)
    rules = param_rules(spec)

    with atomic_dir(Path(out_dir)) as tmp:
        for p in range(pp):
            stage_rules = [r for r in rules if pipeline_stage(r.mcore, spec, pp) == p]
            for t in range(tp):
                tensors = {r.mcore: to_mcore_shard(r, spec, reader.read, t, tp, padded).contiguous()
                           for r in stage_rules}
                save_file(tensors, str(tmp / shard_file(t, p)), metadata={"format": FORMAT})
                if log:
                    print(f"wrote {shard_file(t, p)} ({len(tensors)} tensors)", flush=True)
        meta = {"format": FORMAT, "version": VERSION, "tp": tp, "pp": pp,
                "vocab_pad_multiple": vocab_pad_multiple, "padded_vocab_size": padded}
        (tmp / META).write_text(json.dumps(meta, indent=2))
        copy_model_files(Path(hf_dir), tmp)


def read_meta(ckpt_dir: str | Path) -> dict[str, int]:
    path = Path(ckpt_dir) / META
    if not path.is_file():
        models = sorted(p.parent.name for p in Path(ckpt_dir).glob(f"*/{META}"))
        hint = (f" It is a training step's checkpoint: pass one of its models, e.g. `{Path(ckpt_dir) / models[0]}` "
                f"(it holds {', '.join(models)}).") if models else ""
        raise UserError(f"`{ckpt_dir}` is not a megarl Megatron checkpoint (no {META}). Pass a directory "
                        f"written by `python -m megarl.convert hf-to-mcore` or by training.{hint}")
    try:
        meta = json.loads(path.read_text())
        ok = meta.get("format") == FORMAT and all(isinstance(meta.get(k), int) for k in ("tp", "pp"))
    except (json.JSONDecodeError, AttributeError):
        ok = False
    if not ok:
        raise UserError(f"{path} is corrupt or of another format. Re-create the checkpoint.")
    for key in ("version", "tp", "pp", "ep"):
        value = meta.get(key, 1 if key == "ep" else None)  # ep: written since expert parallelism
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{path} is corrupt: `{key}` is {json.dumps(value)}, but it must be a positive integer "
                            "(a parallel size it was written with). Re-create the checkpoint, or use another "
                            "step's checkpoint of the run.")
    if meta["version"] > VERSION:
        raise UserError(f"{path} has format version {meta['version']}; this megarl reads up to {VERSION}. "
                        "Upgrade megarl.")
    return meta


def saved_shards(ckpt_dir: str | Path) -> Callable[[int, str], torch.Tensor]:
    """get(tp_rank, canonical name): the tensor a checkpoint saved for that TP rank, read on demand.

    Names are looked up in whichever PP file holds them rather than by layer index, since an
    interleaved (virtual) pipeline stores non-adjacent layers in one file.
    """
    ckpt = Path(ckpt_dir)
    meta = read_meta(ckpt)
    where: dict[tuple[int, str], Any] = {}
    for t in range(meta["tp"]):
        for p in range(meta["pp"]):
            for e in range(meta.get("ep", 1)):
                path = ckpt / shard_file(t, p, e)
                try:
                    handle = safe_open(str(path), framework="pt")
                except (SafetensorError, OSError) as err:
                    raise UserError(f"checkpoint shard `{path}` is missing or unreadable ({err}). "
                                    "The checkpoint is incomplete; re-create it.") from None
                where |= {(t, name): handle for name in handle.keys()}

    def get(tp_rank: int, name: str) -> torch.Tensor:
        if (tp_rank, name) not in where:
            raise UserError(f"checkpoint `{ckpt}` lacks `{name}` (TP rank {tp_rank}). The checkpoint does not "
                            "match its config.json; re-create it.")
        return where[tp_rank, name].get_tensor(name)

    return get


def open_mcore(ckpt_dir: str | Path) -> tuple[ModelSpec, Iterator[tuple[str, torch.Tensor]]]:
    """The model spec of a megarl Megatron checkpoint and its HF tensors, merged from the TP shards
    one parameter at a time. The checkpoint is validated before this returns. A critic's or reward model's
    checkpoint (a scalar head) comes out as its `*ForSequenceClassification` with one label: the body's tensors
    and ``score.weight``."""
    meta = read_meta(ckpt_dir)
    tp, critic = meta["tp"], bool(meta.get("critic"))
    spec, get = load_spec(ckpt_dir), saved_shards(ckpt_dir)

    def merged() -> Iterator[tuple[str, torch.Tensor]]:
        shapes = hf_shapes(spec)
        for rule in param_rules(spec, include_output=not critic):
            yield from to_hf(rule, spec, [get(t, rule.mcore) for t in range(tp)], shapes).items()
        if critic:  # the value head, replicated over TP
            yield HEAD, get(0, "output_layer.weight")

    if critic:
        return dataclasses.replace(spec, hf_config=reward_config(spec.hf_config, f"checkpoint `{ckpt_dir}`")), merged()
    return spec, merged()


def reshard(spec: ModelSpec, get: Callable[[int, str], torch.Tensor], saved: dict[str, int], names: Iterable[str],
            tp_rank: int, tp: int, padded_vocab: int, critic: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """This TP rank's shard of each canonical parameter in ``names``, from shards saved in another layout.

    ``get`` serves the saved shards (see saved_shards) and ``saved`` is that layout's meta (tp,
    padded_vocab_size). Each parameter's saved TP shards are merged into its HF tensors and split
    again, one parameter at a time. The mapping only moves elements, so it serves any tensor shaped
    like the parameters (Adam moments, fp32 master weights) as well as the weights.
    """
    tied = spec.tie_word_embeddings and not critic
    if (saved["tp"], saved["padded_vocab_size"]) == (tp, padded_vocab):
        for name in names:
            # A run saved without PP has no separate copy of a tied output layer.
            yield name, get(tp_rank, "embedding.word_embeddings.weight" if tied and name == "output_layer.weight"
                            else name)
        return
    rules = {r.mcore: r for r in param_rules(spec, include_output=not critic)}
    if tied:
        # With PP > 1 the last stage keeps its own copy of the tied embedding as its output layer.
        rules["output_layer.weight"] = ParamRule("output_layer.weight", ("model.embed_tokens.weight",), VOCAB)
    producer = {hf: rule for rule in param_rules(spec, include_output=not critic) for hf in rule.hf}
    shapes = hf_shapes(spec)
    merged: dict[str, torch.Tensor] = {}

    def read(hf: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        if hf not in merged:  # q, k, v (gate, up) are read in turn from one merged parameter
            rule = producer[hf]
            merged.clear()
            merged.update(to_hf(rule, spec, [get(t, rule.mcore) for t in range(saved["tp"])], shapes))
        return merged[hf] if dim is None else merged[hf].narrow(dim, start, stop - start)

    for name in names:
        if name in rules:
            yield name, to_mcore_shard(rules[name], spec, read, tp_rank, tp, padded_vocab)
        else:  # the critic's value head, replicated over TP
            yield name, get(0, name)
