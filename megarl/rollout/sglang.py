"""SGLang rollout engine: one ``sglang.Engine`` per rollout group, colocated with the trainer.

Two ways to hand weights over, both already in SGLang's per-rank layout:
- in-engine copy (``attach``, then ``apply`` per update, ``detach`` before the trainer's weights leave
  the GPU; what the RL loop uses): megarl's loader (megarl.rollout.sglang_loader, registered as a
  custom weight loader) runs inside every engine rank, keeps the trainer tensors on its GPU open by
  CUDA IPC and replays one compiled copy kernel from them into its parameters (megarl.reshard.handover);
- ``update_weights(named_tensors)``: engine-layout tensors filled by the resharder, delivered by
  ``update_weights_from_tensor(load_format="direct")``, one IPC handle per tensor per update.
With rollout.alias_weights the engine's model is built by megarl's loader (``sglang_loader.AliasingLoader``, the
``load_format``): parameters that are runs of the actor's tensors are views of them, and the copy skips them.
SGLang >= 0.5.22 requires
``begin_weight_update`` / ``end_weight_update`` around updates; 0.5.17 lacks them, so both are
called only when present. Logprobs of sampled tokens are SGLang's default, log softmax(logits / T).
Colocation: ``sleep`` releases weights and KV cache (torch memory
saver, ``enable_memory_saver``) while the trainer trains; ``wake`` resumes them, the weights alone
first when the trainer hands over before it frees its own copy (``wake("weights")``, then ``wake("cache")``).

A failed engine process (out of memory at wake, a crashed scheduler) sends SIGQUIT to this process, and
SGLang's own handler answers by SIGKILLing the whole process tree, this process included: the user
would see only torchrun's ChildFailedError. The engine replaces that handler, at start and once it
runs, with one that ends the pending engine call, which then raises with the engine's log tail
(megarl.rollout.failures turns it into a megarl error naming the phase and the memory in use). SGLang's loop
also takes SIGTERM (to drain requests, then SIGKILL the process tree); the watch gives it back to megarl's
clean interrupt.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import dataclasses
import json
import logging
import signal
import uuid
from collections.abc import Sequence
from multiprocessing.util import Finalize
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import torch

from megarl.config.lora import TARGETS
from megarl.errors import UserError
from megarl.models.routing import routing_dtype
from megarl.models.spec import load_spec
from megarl.reshard.engine_layout import check_rollout_tp
from megarl.reshard.fp8_reference import BLOCK
from megarl.reshard.handover import apply_message, detach_message
from megarl.rollout.base import (
    Completion,
    Enough,
    SamplingParams,
    Wake,
    check_prompts,
    engine_process_env,
    request_budget,
    request_seed,
    visible_devices_env,
)
from megarl.rollout.enginelog import EngineLog
from megarl.rollout.failures import ChildWatch
from megarl.rollout.sglang_fp8 import Fp8ModelDir, fp8_engine_args
from megarl.rollout.sglang_loader import ALIASES_KEY, LOADER, AliasingLoader
from megarl.rollout.sglang_lora import AdapterSlot, lora_engine_args
from megarl.rollout.stops import ends_in_stop, model_eos_ids
from megarl.rollout.watchdog import Watchdog

log = logging.getLogger(__name__)

SGLANG_TAGS: dict[str, list[str] | None] = {"all": None, "weights": ["weights"], "cache": ["kv_cache", "cuda_graph"]}
"""What ``wake(what)`` resumes: SGLang's memory-saver tags (None: all of them)."""

GRAPH_SHAPE_ARGS = ("cuda_graph_config", "cuda_graph_max_bs_decode", "cuda_graph_bs_decode", "cuda_graph_max_bs",
                    "cuda_graph_bs")
"""Engine arguments that set which decode batch sizes SGLang captures as CUDA graphs (they keep SGLang's say)."""


def decode_graph_args(max_batch: int | None, tensor_parallel: int, engine_args: dict[str, Any],
                      server_args: set[str]) -> dict[str, int]:
    """Capture decode CUDA graphs up to ``max_batch`` (the most sequences one generate call runs at once) where
    that is above SGLang's own limit on 80-141 GB GPUs (256 below TP 4, 512 from it): SGLang decodes larger
    batches without graphs, 3.3x slower for SmolLM2 at 512 sequences on an H200 (benchmarks/results/h200/
    rollout_speed). Nothing when the engine arguments set the graphs' sizes or turn them off, or when this SGLang
    has no such argument (``server_args``: its ServerArgs fields)."""
    floor = 512 if tensor_parallel >= 4 else 256
    if max_batch is None or max_batch <= floor or any(k in engine_args for k in GRAPH_SHAPE_ARGS) \
            or engine_args.get("disable_cuda_graph") or engine_args.get("disable_decode_cuda_graph"):
        return {}
    name = next((k for k in ("cuda_graph_max_bs_decode", "cuda_graph_max_bs") if k in server_args), None)
    return {name: max_batch} if name else {}


class SGLangEngine:
    """A real SGLang engine over ``tensor_parallel`` GPUs (this process drives it)."""

    copies_in_engine = True

    def __init__(self, hf_dir: str, *, tensor_parallel: int = 1, gpu_memory_fraction: float = 0.7,
                 max_model_len: int | None = None, seed: int = 0, enable_sleep: bool = True,
                 load_format: str = "auto", devices: list[int] | None = None, log_file: Path | None = None,
                 return_routed_experts: bool = False, aliases: Path | None = None, max_batch: int | None = None,
                 lora_rank: int | None = None, lora_targets: Sequence[str] = TARGETS, weight_dtype: str = "bf16",
                 fp8_block: int = BLOCK, **engine_args: Any) -> None:
        """``devices``: the GPUs (this node's indices) the engine runs on (None: the first ``tensor_parallel``
        visible ones); ``log_file``: where the engine's processes log (None: the console); ``max_batch``: the most
        sequences one rollout's generate call runs at once, which decode CUDA graphs cover (``decode_graph_args``);
        ``return_routed_experts`` (MoE): every completion carries the experts its tokens were routed to;
        ``aliases``: the file of the parameters that map the actor's memory, per engine rank (rollout.alias_weights:
        the model is built by megarl's loader, megarl.rollout.sglang_loader.AliasingLoader); ``lora_rank``: serve
        LoRA adapters of this rank on ``lora_targets`` (actor.lora's names; ``load_adapter``, sglang_lora);
        ``weight_dtype``: "fp8" starts the engine in block FP8 for the hand-over (rollout.weight_dtype, sglang_fp8),
        in blocks of ``fp8_block`` x ``fp8_block`` (rollout.fp8_block);
        ``engine_args`` go to ``sglang.Engine`` unchanged."""
        sigterm = signal.getsignal(signal.SIGTERM)  # megarl's interrupt handling, which the engine's loop takes over
        fp8 = weight_dtype == "fp8"
        spec = load_spec(hf_dir)  # unsupported architectures fail here, before any GPU work
        check_rollout_tp(spec, tensor_parallel)
        assert not return_routed_experts or spec.is_moe, "routed experts of a dense model"
        self._routing = (spec.num_layers, spec.num_experts_per_tok, spec.num_experts) if return_routed_experts \
            else None
        engine_log = EngineLog(Path(log_file) if log_file else None)
        try:
            with engine_log.capture():
                import sglang
        except ImportError as err:
            raise UserError(f"rollout.engine = sglang but SGLang cannot be imported ({err}). Install the GPU "
                            "image (Dockerfile) or use rollout.engine = vllm.") from None
        self.tensor_parallel = tensor_parallel
        self.releases_memory = enable_sleep
        """Whether sleep() frees the weights and the KV cache (SGLang's memory saver)."""
        self.max_model_len = max_model_len or spec.max_position_embeddings
        self.vocab_size = spec.vocab_size
        self._eos_ids = frozenset(model_eos_ids(hf_dir))
        args = dict(model_path=hf_dir, tp_size=tensor_parallel, skip_tokenizer_init=True,
                    mem_fraction_static=gpu_memory_fraction, random_seed=seed,
                    enable_memory_saver=enable_sleep, context_length=self.max_model_len,
                    load_format=load_format, custom_weight_loader=[LOADER]) | engine_args
        if aliases is not None:
            args |= {"load_format": AliasingLoader,
                     "model_loader_extra_config": json.dumps({ALIASES_KEY: str(aliases)})}
        if lora_rank:
            args |= lora_engine_args(lora_rank, lora_targets, engine_args, spec.is_moe)
        from sglang.srt.server_args import ServerArgs

        server_args = {f.name for f in dataclasses.fields(ServerArgs)}
        self._fp8_dir: Fp8ModelDir | None = None
        if fp8:
            args |= fp8_engine_args(engine_args, load_format, aliases, server_args)
            self._fp8_dir = Fp8ModelDir.create(hf_dir, fp8_block)
            atexit.register(self._fp8_dir.remove)  # however this process ends
            args["model_path"] = str(self._fp8_dir.path)
        args |= decode_graph_args(max_batch, tensor_parallel, engine_args, server_args)
        if "custom_sigquit_handler" in server_args:
            args["custom_sigquit_handler"] = _failed_at_start
        if return_routed_experts:
            if "enable_return_routed_experts" not in server_args:
                raise UserError(f"algorithm.routing_replay needs an SGLang that returns routed experts "
                                f"(enable_return_routed_experts, in 0.5.17); this is {sglang.__version__}. "
                                "Install the GPU image's SGLang, or set algorithm.routing_replay: false.")
            args["enable_return_routed_experts"] = True
        self._watchdog = Watchdog(engine_log.path)  # the engine's processes die with this one, however it ends
        try:
            # SGLang's logprobs are those of softmax(logits / T), the distribution it samples from and the one
            # the trainer computes; this variable would switch them to T = 1, so it is pinned off.
            env = visible_devices_env(devices) | {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}
            with engine_log.capture(), engine_process_env(**env, **self._watchdog.env):
                self.engine = sglang.Engine(**args)
            # SGLang's own exit hook is its shutdown, which SIGKILLs every descendant of this process; see shutdown().
            atexit.unregister(self.engine.shutdown)
            # megarl's takes its place, however this process ends (an error, an interrupt): see shutdown().
            self._at_exit = Finalize(None, self._end_processes, exitpriority=0)
        except Exception as err:  # the engine's own exception carries its log tail
            engine_log.drain()
            self._watchdog.stop()
            if self._fp8_dir is not None:
                self._fp8_dir.remove()
            raise UserError(f"SGLang failed to start for {hf_dir} (tp={tensor_parallel}): "
                            f"{str(err)[-2000:]} Engine log: {engine_log.summary()[-1500:]}") from None
        # The KV cache the engine sized for itself next to the trainer: what colocation leaves it. This first
        # request also creates the loop the engine's calls run on, and SGLang puts its SIGQUIT handler on it
        # (a loop made before it would not be the engine's: its calls would hang): the watch replaces it.
        self._watchdog.started()
        tokens = self.engine.get_server_info().get("max_total_num_tokens")
        loop = getattr(getattr(self.engine, "tokenizer_manager", None), "event_loop", None)
        self._watch = ChildWatch(loop, engine_log, "an SGLang engine process", sigterm=sigterm)
        print(f"megarl: SGLang engine on devices {devices}: KV cache of {tokens} tokens "
              f"(mem_fraction_static {gpu_memory_fraction})", flush=True)
        self._versioned_updates = hasattr(self.engine, "begin_weight_update")
        self._attached: str | None = None
        self._token: torch.Tensor | None = None
        self._cache_awake = True
        self._adapter = AdapterSlot(self.engine)

    @staticmethod
    def package(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, bytes]]:
        """This rank's part of a message to megarl's loader in the engine (``EngineCopy.to_wire``,
        ``checksum_message``): CUDA IPC handles of its tensors, no data copied."""
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()  # devices travel as UUIDs: engine processes see other device indices
        return [(name, MultiprocessingSerializer.serialize(t)) for name, t in named]

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        check_prompts(prompts, params, self.max_model_len, self.vocab_size)
        expanded = [list(p) for p in prompts for _ in range(params.n)]
        with self._watch.alive():
            outputs = self.engine.generate(input_ids=expanded, sampling_params=self._requests(params, len(expanded)),
                                           return_logprob=True, **self._request_args())
        stop_ids = self._eos_ids | set(params.stop_token_ids)
        return [self._completion(out, i // params.n, len(expanded[i]), stop_ids) for i, out in enumerate(outputs)]

    def generate_until(self, prompts: Sequence[Sequence[int]], params: SamplingParams, enough: Enough
                       ) -> list[Completion]:
        """``Aborting``: one request per prompt on the engine's event loop; ``enough`` is asked whenever requests
        finish, and once it says so the rest are aborted in the scheduler (a running one decodes one more token,
        which it keeps). An aborted request answers with every token and logprob it had (non-streaming)."""
        check_prompts(prompts, params, self.max_model_len, self.vocab_size)
        if params.n != 1:
            raise ValueError(f"generate_until samples once per prompt (n = {params.n})")
        # SGLang aborts every request whose id *starts with* the one named: ids of one length never collide.
        rids = [uuid.uuid4().hex for _ in prompts]
        manager = self.engine.tokenizer_manager
        outputs: list[dict | None] = [None] * len(prompts)

        async def run() -> None:
            calls = [asyncio.ensure_future(self.engine.async_generate(
                input_ids=list(p), sampling_params=request, return_logprob=True, rid=rid, **self._request_args()))
                for p, request, rid in zip(prompts, self._requests(params, len(prompts)), rids, strict=True)]
            # Each call reports itself when done: asyncio.wait over the pending set would cost a pass over every
            # request for each finish, Python time taken from the learner beside it (async_rl separate).
            done: asyncio.Queue[int] = asyncio.Queue()
            for i, call in enumerate(calls):
                call.add_done_callback(lambda _, i=i: done.put_nowait(i))
            finished: list[int] = []
            for answered in range(1, len(calls) + 1):
                i = await done.get()
                out = outputs[i] = calls[i].result()
                if (out["meta_info"].get("finish_reason") or {}).get("type") != "abort":
                    finished.append(i)
                if done.empty() and answered < len(calls) and enough(finished):
                    pending = [(i, call) for i, call in enumerate(calls) if outputs[i] is None]
                    for i, _ in pending:
                        manager.abort_request(rid=rids[i])
                    await asyncio.wait([call for _, call in pending])
                    for i, call in pending:
                        outputs[i] = call.result()
                    return

        with self._watch.alive():
            try:
                self.engine.loop.run_until_complete(run())
            finally:  # stopped, interrupted or failed: nothing of this call stays in the engine
                for rid, out in zip(rids, outputs, strict=True):
                    if out is None:
                        manager.abort_request(rid=rid)
        stop_ids = self._eos_ids | set(params.stop_token_ids)
        return [self._completion(out, i, len(prompts[i]), stop_ids, abortable=True)
                for i, out in enumerate(cast(list[dict], outputs))]

    def _requests(self, params: SamplingParams, count: int) -> list[dict[str, Any]]:
        """SGLang's sampling parameters of ``count`` requests, ``params.n`` per prompt in prompt order: a request
        samples once (n = 1), with its prompt's budget and seed (sample j of a prompt seeded + j)."""
        sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                    "stop_token_ids": list(params.stop_token_ids), "n": 1}
        requests = []
        for i in range(count):
            prompt, sample = divmod(i, params.n)
            seed = request_seed(params, prompt)
            requests.append(sampling | {"max_new_tokens": request_budget(params, prompt)}
                            | ({"sampling_seed": seed + sample} if seed is not None else {}))
        return requests

    def _routing_arg(self) -> dict[str, bool]:
        return {"return_routed_experts": True} if self._routing else {}

    def _request_args(self) -> dict[str, Any]:
        """What every generate request adds: routed experts (MoE replay), and the adapter to serve (LoRA)."""
        return self._routing_arg() | self._adapter.request()

    def load_adapter(self, path: str | Path) -> None:
        """Serve the PEFT adapter in directory ``path`` from the next request on, in place of the last one (the
        engine started with ``lora_rank``); SGLang reads the directory here."""
        with self._watch.alive():
            self._adapter.load(path)

    def _completion(self, out: dict, prompt_index: int, prompt_len: int, stop_ids: frozenset[int],
                    abortable: bool = False) -> Completion:
        """SGLang checks an abort, then the budget, then the stop tokens: a sample whose last token is one of
        ``stop_ids`` is complete ("stop") though SGLang says "length" or "abort" (megarl.rollout.stops)."""
        meta = out["meta_info"]
        finish = (meta.get("finish_reason") or {}).get("type")
        tokens = list(out["output_ids"])
        logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        if len(logprobs) != len(tokens):
            raise RuntimeError(f"SGLang returned {len(tokens)} tokens but {len(logprobs)} logprobs for prompt "
                               f"{prompt_index} (finish reason {finish!r})")
        if finish == "abort" and not abortable:
            raise RuntimeError(f"SGLang aborted prompt {prompt_index}'s request: {meta.get('finish_reason')}")
        if (meta.get("finish_reason") or {}).get("matched") == "NaN happened":
            # SGLang sampled outside the vocabulary (NaN probabilities) and wrote a stop token in its place: a clean
            # stop to anything downstream, trained with the logprob of a token never sampled.
            raise RuntimeError(f"SGLang's sampler met NaN probabilities in prompt {prompt_index}'s sample (the engine "
                               "replaced the token with a stop token). The engine's weights or logits are not finite:"
                               " check the last weight hand-over (rollout.verify_every) and the learning rate.")
        reason: Literal["stop", "length", "abort"] = finish if finish in ("length", "abort") \
            and not ends_in_stop(tokens, stop_ids) else "stop"
        return Completion(prompt_index=prompt_index, token_ids=tokens, logprobs=logprobs, finish_reason=reason,
                          routed_experts=None if self._routing is None else decode_routed_experts(
                              meta.get("routed_experts"), prompt_len + len(tokens) - 1, *self._routing))

    def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """Engine-layout tensors of this GPU's engine rank (tensor_parallel == 1 in one process)."""
        assert self.tensor_parallel == 1, "use update_weights_from_ranks for engines over several GPUs"
        self.update_weights_from_ranks([serialize_for_engine(named_tensors)])

    def update_weights_from_ranks(self, per_rank: list[dict[str, bytes]]) -> None:
        """Deliver handles gathered from every engine rank (``serialize_for_engine`` on each GPU's process)."""
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor

        assert len(per_rank) == self.tensor_parallel
        payload = [(name, LocalSerializedTensor(values=[rank[name] for rank in per_rank])) for name in per_rank[0]]
        self._update(payload, "direct", flush_cache=True)

    def attach(self, per_rank: list[list[tuple[str, bytes]]], key: str) -> None:
        """Hand every engine rank its trainer tensors and copy (``package(copy.to_wire(...))`` on each rank's process);
        they must stay allocated at the same addresses until the next ``attach`` under ``key``."""
        assert len(per_rank) == self.tensor_parallel
        self._update(_payload(per_rank), LOADER, flush_cache=False)
        self._attached = key
        self._token = torch.zeros(1, device="cuda")

    def apply(self, round: int = 0) -> None:
        """Copy round ``round`` of the attached trainer tensors' current values into the engine's parameters."""
        assert self._attached is not None and self._token is not None, "attach() first"
        torch.cuda.synchronize()  # the engine reads what this process's streams wrote
        # One awake holds prefixes of the old weights; one asleep is flushed when it wakes (wake).
        self._update(apply_message(self._attached, self._token, round), LOADER,
                     flush_cache=self._cache_awake and round == 0)

    def checksums(self, per_rank: list[list[tuple[str, bytes]]]) -> None:
        """Every engine rank writes its parameters' checksums into the trainer tensor its rank sent
        (``package(checksum_message(...))`` on each rank's process)."""
        assert len(per_rank) == self.tensor_parallel
        self._update(_payload(per_rank), LOADER, flush_cache=False)

    def detach(self) -> None:
        """Every engine rank closes its mappings of the trainer's tensors (until the next ``attach``)."""
        if self._attached is not None and self._token is not None:
            self._update(detach_message(self._attached, self._token), LOADER, flush_cache=False)
        self._attached = None

    def _update(self, payload: list, load_format: str, flush_cache: bool) -> None:
        with self._watch.alive():
            if self._versioned_updates:
                self.engine.begin_weight_update(selector="all")
            ok, message = self.engine.update_weights_from_tensor(payload, load_format=load_format,
                                                                 flush_cache=flush_cache)
            if self._versioned_updates:
                self.engine.end_weight_update()
        if not ok:
            raise RuntimeError(f"SGLang rejected the weight update: {message}")

    def sleep(self) -> None:
        with self._watch.alive():
            self.engine.release_memory_occupation()
        self._cache_awake = False

    def wake(self, what: Wake = "all") -> None:
        """A KV cache that wakes is flushed: released is not flushed in a build with enable_kv_cache_cpu_backup,
        which restores the cache and its prefix tree, of the weights before the hand-over, on wake."""
        with self._watch.alive():
            self.engine.resume_memory_occupation(tags=SGLANG_TAGS[what])
            if what != "weights":
                flushed = self.engine.flush_cache()
                if getattr(flushed, "success", True) is False:
                    raise RuntimeError(f"SGLang did not flush its KV cache on wake: {flushed}")
        self._cache_awake = self._cache_awake or what != "weights"

    def shutdown(self) -> None:
        """End the engine's processes (the watchdog's recorded ones), and wait until they are gone. Not SGLang's
        own shutdown (nor its exit hook, unregistered at start): it SIGKILLs every descendant of this process,
        multiprocessing's resource tracker included, whose replacement then fails at exit on the semaphores the
        first one held (a KeyError '/loky-...' traceback, seen on an H200 after a finished run).

        Runs once: also at this process's exit if no one called it (``_at_exit``). SGLang's schedulers and
        detokenizer are multiprocessing's non-daemon children, which multiprocessing joins at exit, and they never
        end by themselves while this process lives; nor does the watchdog end them before this process is gone. A
        run that stopped with an error had not shut its engine down (the trainer's close runs after a finished run
        or an interrupt): after an adapter SGLang refused in the first hand-over, the run printed its error and then
        waited in that join for over 7 minutes, holding the GPU. A multiprocessing finalizer of priority 0 runs in
        that exit function before the join, whatever order the exit hooks were registered in (multiprocessing
        moves its own to run first whenever its logger is set up), never in a forked child, and only once."""
        self._at_exit()

    def _end_processes(self) -> None:
        self._watchdog.stop(wait_s=30.0)
        if self._fp8_dir is not None:
            self._fp8_dir.remove()


def decode_routed_experts(encoded: str | None, num_tokens: int, num_layers: int, topk: int, num_experts: int
                          ) -> np.ndarray:
    """SGLang's ``meta_info["routed_experts"]`` (base64 of int32 [tokens, layers, k]) -> [num_tokens, num_layers,
    topk] in megarl's routing dtype; anything else is the engine breaking its contract, which replay must not
    train on."""
    if encoded is None:
        raise RuntimeError("SGLang returned no routed experts although the request asked for them "
                           "(enable_return_routed_experts)")
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if flat.size != num_tokens * num_layers * topk:
        raise RuntimeError(f"SGLang returned {flat.size} routed expert ids for {num_tokens} tokens x {num_layers} "
                           f"layers x top-{topk} = {num_tokens * num_layers * topk}")
    if flat.size and not 0 <= flat.min() <= flat.max() < num_experts:
        raise RuntimeError(f"SGLang returned expert ids in [{flat.min()}, {flat.max()}] for a model of "
                           f"{num_experts} experts")
    return flat.reshape(num_tokens, num_layers, topk).astype(routing_dtype(num_experts))


def _failed_at_start(*_: object) -> None:
    """SIGQUIT while the engine starts: raised in the constructor's ``sglang.Engine`` call."""
    raise RuntimeError("an SGLang engine process failed while the engine started (it signalled SIGQUIT)")


def _payload(per_rank: list[list[tuple[str, bytes]]]) -> list:
    """One message from every engine rank's part: each name carries one serialized tensor per rank."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor

    return [(name, LocalSerializedTensor(values=[rank[i][1] for rank in per_rank]))
            for i, (name, _) in enumerate(per_rank[0])]


def serialize_for_engine(named_tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """CUDA IPC handles of this GPU's engine-layout tensors (no data is copied)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    return {name: MultiprocessingSerializer.serialize(t.detach()) for name, t in named_tensors.items()}
