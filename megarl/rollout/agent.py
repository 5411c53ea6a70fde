"""Multi-turn, tool-using rollouts: generate until a tool call or the end, run the calls, append the observations
as tokens, generate on from the whole sequence.

Every engine call holds all live samples (one ``n=1`` request each), so a turn is one batched call. The policy's
tokens are kept exactly as the engine produced them (cut at the token that completes ``call_end``, never
re-tokenized); only the observation's tool turn is tokenized. Each sample's response is its policy and tool
tokens interleaved, with a mask of 1 at the policy's tokens and 0 at the tool's, whose rollout logprobs are 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast

import numpy as np
import torch

from megarl.config import AgentConfig
from megarl.errors import UserError
from megarl.rollout.base import Completion, SamplingParams, request_seed
from megarl.tools.base import load_tool
from megarl.tools.inert import InertText
from megarl.tools.pool import ToolPool, ToolResult

STATS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_sandbox_failures", "tool_wall_s", "tool_tokens",
         "cut_by_budget", "cut_by_turns", "engine_calls", "wasted_tokens", "loop_s")
"""Per-sample statistics of a multi-turn rollout (Completion.stats), means logged as agent/<name>. ``loop_s``: the
seconds the loop itself spent on the sample between engine calls (finding a call's end, parsing it, encoding the
tool's answer), its overhead apart from the engine's and the tools' time. ``tool_sandbox_failures``: calls whose
tool says its sandbox failed them (``ToolOutput.metadata["sandbox_failed"]``), errors of the machine and not of
the model's program, counted among ``tool_errors`` too."""

_SEED_STRIDE = 1 << 40
"""A sample's engine call c samples at its first call's seed + c * stride (its first is the single-turn rollout's):
no seed repeats while the first calls' seeds (rollout.seed + a round's offset + the sample's place) stay below it."""


class Generator(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...


@dataclass(slots=True)
class _Sample:
    prompt_index: int
    prompt: list[int]
    index: int
    """k = prompt index * n + j: its place in the batch, and its seeds."""
    budget: int
    """Most response tokens, policy and tool tokens together."""
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STATS, 0.0) | {"turns": 1.0})
    finish: Literal["stop", "length"] | None = None
    turn_start: int = 0
    """Where the current turn's tokens begin in ``tokens`` (a turn may span engine calls)."""
    call: tuple[str, str] | str | None = None
    """The tool call its last turn ended in, (tool, call) or the error observation, until its observation."""
    seed: int | None = None
    """The seed its latest engine call sampled at: a tool call it ended in runs at it (ToolPool.run)."""
    routed: np.ndarray | None = None
    """MoE engines returning routing: the latest call's experts, which cover the whole sequence so far (the
    engine reports a cached prefix's experts as it routed them when it first ran those tokens)."""

    def extend(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        self.tokens += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


STUCK_SLACK_S = 30.0
"""How long past twice agent.tool_timeout_s the loop waits for any tool call to end before it calls the tools'
event loop stuck."""


class AgentLoop:
    """Multi-turn rollouts with ``cfg``'s tools; ``encode``/``decode`` are the policy's tokenizer (no special tokens
    added), ``context`` the engine's max_model_len. ``inert`` makes tool output unable to spell a special token
    (megarl.tools.inert; make_rollout passes the tokenizer's)."""

    def __init__(self, cfg: AgentConfig, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 context: int, inert: Callable[[str], str] = str) -> None:
        self.cfg, self.encode, self.decode, self.context, self.inert = cfg, encode, decode, context, inert
        self.pool = ToolPool([load_tool(t.spec, **t.args) for t in cfg.tools], max_workers=cfg.tool_workers,
                             timeout_s=cfg.tool_timeout_s, output_chars=cfg.tool_output_chars)
        # The engine stops at call_end's last token: a call ends there (when the model writes call_end as the
        # tokenizer does), and a sample stopped there short of a call goes on in the next engine call.
        end = encode(cfg.call_end)
        self._pause: tuple[int, ...] = (end[-1],) if cfg.pause_at_call_end or len(end) == 1 else ()
        self._sandbox_warned = False
        # The tools' event loop runs in a thread of its own: calls go on while the engine generates.
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="megarl-tools", daemon=True)
        self._thread.start()

    def generate(self, engine: Generator, prompts: Sequence[Sequence[int]], params: SamplingParams
                 ) -> list[Completion]:
        """``params.n`` samples per prompt, grouped by prompt, as ``engine.generate`` returns them. Each response,
        policy and tool tokens together, holds at most ``params.max_new_tokens`` (the caller's limit: training's,
        an eval's), and at most agent.max_total_tokens."""
        budget = min(params.max_new_tokens, self.cfg.max_total_tokens or params.max_new_tokens)
        samples = [_Sample(k // params.n, list(prompts[k // params.n]), index=k, budget=budget)
                   for k in range(len(prompts) * params.n)]
        ready, running = list(samples), dict[futures.Future[ToolResult], _Sample]()
        while ready or running:
            if ready:
                self._call_engine(engine, ready, params)
                for s in ready:
                    if s.call is not None:
                        running[self._run_tool(s.call, s.seed)] = s
                ready = [s for s in ready if s.finish is None and s.call is None]
            if running:  # the next engine call takes the samples whose tools are done
                done, _ = futures.wait(running, timeout=self.cfg.tool_wait_s)
                if not done and not ready:  # the engine would idle: it waits for one at least
                    done = self._wait_for_a_tool(running)
                for future in sorted(done, key=lambda f: running[f].index):
                    s = running.pop(future)
                    start = time.perf_counter()
                    self._observe(s, future.result())
                    s.stats["loop_s"] += time.perf_counter() - start
                    if s.finish is None:
                        ready.append(s)
                ready.sort(key=lambda s: s.index)
        return [Completion(prompt_index=s.prompt_index, token_ids=s.tokens, logprobs=s.logprobs, finish_reason=s.finish
                           or "length", policy_mask=s.mask, stats=s.stats, routed_experts=_routing(s))
                for s in samples]

    def _wait_for_a_tool(self, running: dict[futures.Future[ToolResult], _Sample]) -> set[Any]:
        """The calls done once one is. Every call ends by agent.tool_timeout_s on the tools' event loop: none ending
        well past it means the loop itself is stuck, which would hang the run silently."""
        limit = 2 * self.cfg.tool_timeout_s + STUCK_SLACK_S
        done, _ = futures.wait(running, timeout=limit, return_when=futures.FIRST_COMPLETED)
        if not done:
            state = "has stopped" if not self._thread.is_alive() else "is blocked"
            raise UserError(
                f"no tool call of {len(running)} has ended in {limit:g} s, though each ends at agent.tool_timeout_s "
                f"= {self.cfg.tool_timeout_s:g} s: the tools' event loop {state}. An async tool (`async def run`) "
                "that calls something blocking (time.sleep, a socket read, file I/O) holds the loop and every other "
                "call with it. Fix: await asyncio.to_thread(...) for its blocking work, or make its run a plain def "
                "(it then runs in a thread of its own).")
        return done

    def _call_engine(self, engine: Generator, batch: list[_Sample], params: SamplingParams) -> None:
        """One engine call of every sample in ``batch``; each gets its output and, where its turn ended in a tool
        call, ``call``. The c-th call of prompt i's j-th sample samples at request_seed(params, i) + j + c * stride,
        whichever samples share it: its first is the single-turn rollout's."""
        # One max_new_tokens per call: the most any sample may still take, within every sample's context; a
        # sample cut short of its budget by another's context goes on in the next call.
        limit = min(max(s.budget - len(s.tokens) for s in batch),
                    min(self.context - len(s.prompt) - len(s.tokens) for s in batch))
        seeded = params.seed is not None or params.seeds is not None
        for s in batch:
            s.seed = (cast(int, request_seed(params, s.prompt_index)) + s.index % params.n
                      + int(s.stats["engine_calls"]) * _SEED_STRIDE) if seeded else None
        seeds = [cast(int, s.seed) for s in batch] if seeded else None
        turn = dataclasses.replace(params, n=1, max_new_tokens=limit, seed=None, seeds=seeds,
                                   stop_token_ids=(*params.stop_token_ids, *self._pause))
        outs = engine.generate([s.prompt + s.tokens for s in batch], turn)
        for s, out in zip(batch, outs, strict=True):
            start = time.perf_counter()
            text = self._take(s, out, params)
            s.call = None if text is None else self.parse(text)
            s.stats["loop_s"] += time.perf_counter() - start

    def _run_tool(self, call: tuple[str, str] | str, seed: int | None) -> futures.Future[ToolResult]:
        """``call`` (a parsed call, or the error observation of one that did not parse) running on the tools'
        loop, at the sample's ``seed``: a tool that draws at random draws the same whenever and wherever it runs."""
        if isinstance(call, str):
            done: futures.Future[ToolResult] = futures.Future()
            done.set_result(ToolResult(observation=call, status="error", wall_s=0.0))
            return done
        return asyncio.run_coroutine_threadsafe(self.pool.run(*call, seed=seed), self._loop)

    def _take(self, s: _Sample, out: Completion, params: SamplingParams) -> str | None:
        """Append a call's output to ``s``; the text of its turn when that ended in a tool call to run."""
        ids, logprobs = out.token_ids, out.logprobs
        s.routed = out.routed_experts
        s.stats["engine_calls"] += 1
        before = s.tokens[s.turn_start:]
        end = self._call_end(before, ids)
        if end is not None:
            s.stats["wasted_tokens"] += len(ids) - end
            ids, logprobs = ids[:end], logprobs[:end]
        room = s.budget - len(s.tokens)
        s.extend(ids[:room], logprobs[:room])
        paused = bool(self._pause) and tuple(ids[-1:]) == self._pause and ids[-1] not in params.stop_token_ids
        if end is None and out.finish_reason == "stop" and not paused and len(ids) <= room:
            s.finish = "stop"  # its end-of-sequence within the budget, its last token included, as single-turn says
        elif len(ids) > room or (end is None and len(s.tokens) == s.budget):
            s.finish, s.stats["cut_by_budget"] = "length", 1.0
        elif end is None:  # "length" short of the budget: go on, unless nothing came (it would again, forever)
            s.finish = None if paused or ids else "length"
        elif s.stats["turns"] >= self.cfg.max_turns:
            s.finish, s.stats["cut_by_turns"] = "length", 1.0
        else:
            return self.decode(before + ids)
        return None

    def _call_end(self, before: list[int], ids: list[int]) -> int | None:
        """The number of tokens of ``ids`` up to the one that completes ``call_end`` in the decoded text of the turn
        (``before`` + ``ids``), or None."""
        if not ids or self.cfg.call_end not in self.decode(before + ids):
            return None
        low, high = 1, len(ids)  # decoded prefixes only grow, so containing the delimiter is monotone
        while low < high:
            mid = (low + high) // 2
            if self.cfg.call_end in self.decode(before + ids[:mid]):
                high = mid
            else:
                low = mid + 1
        return low

    def _observe(self, s: _Sample, result: ToolResult) -> None:
        """Append the tool turn of ``s``'s call, or end ``s`` when it would leave no room for an answer."""
        s.call = None
        s.stats["tool_calls"] += 1
        s.stats["tool_wall_s"] += result.wall_s
        s.stats["tool_errors"] += result.status == "error"
        s.stats["tool_timeouts"] += result.status == "timeout"
        if result.metadata.get("sandbox_failed"):
            s.stats["tool_sandbox_failures"] += 1
            if not self._sandbox_warned:  # once a process: the statistic counts them
                self._sandbox_warned = True
                print(f"megarl: warning: a tool's sandbox failed a call, which the model sees as an error of its "
                      f"program: {result.metadata.get('end')} (leftover processes: "
                      f"{result.metadata.get('survivors') or 'none'}); agent/tool_sandbox_failures counts them",
                      flush=True)
        obs = self.encode(self.cfg.observation_template.replace("{observation}", self.inert(result.observation)))
        if len(s.tokens) + len(obs) >= s.budget:  # no room left for the policy to answer it
            s.finish, s.stats["cut_by_budget"] = "length", 1.0
            return
        s.extend(obs, None)
        s.turn_start = len(s.tokens)
        s.stats["tool_tokens"] += len(obs)
        s.stats["turns"] += 1

    def parse(self, turn: str) -> tuple[str, str] | str:
        """(tool name, call) from a turn's text ending in ``call_end``, or the error observation. The call is JSON
        {"name": ..., "arguments": ...} (arguments that are not a string are passed as JSON text), or with a
        single tool its plain text."""
        body = turn[: turn.index(self.cfg.call_end)]
        start = body.rfind(self.cfg.call_start) if self.cfg.call_start else -1
        body = (body[start + len(self.cfg.call_start):] if start >= 0 else body).strip()
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and "arguments" in obj:
            args = obj["arguments"]
            return obj["name"], args if isinstance(args, str) else json.dumps(args)
        names = sorted(self.pool.tools)
        if len(names) == 1:
            return names[0], body
        return (f'error: a tool call must be JSON {{"name": ..., "arguments": ...}} between {self.cfg.call_start} '
                f"and {self.cfg.call_end}, naming one of {names}")

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def _routing(s: _Sample) -> np.ndarray | None:
    """The experts of every token the engine ran ([len(prompt) + len(tokens) - 1, layers, k]): the last call's,
    without the rows of tokens the loop cut (past ``call_end`` or the budget)."""
    if s.routed is None:
        return None
    rows = len(s.prompt) + len(s.tokens) - 1
    assert len(s.routed) >= rows, f"the engine's routing covers {len(s.routed)} tokens of {rows}"
    return s.routed[:rows]


def agent_metrics(stats: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, float]:
    """Step metrics of a batch's per-sample ``stats`` ([N] each; none for single-turn) and policy ``mask``."""
    if not stats:
        return {}
    policy = float(mask.sum())
    metrics = ({f"agent/{k}": float(v.mean()) for k, v in stats.items()}
               | {"agent/policy_token_share": policy / max(policy + float(stats["tool_tokens"].sum()), 1.0)})
    if "loop_s" in stats:  # the loop runs in one thread: its samples' overheads add up
        loop = float(stats["loop_s"].sum())
        metrics |= {"agent/loop_s_total": loop,
                    "agent/loop_ms_per_turn": 1000 * loop / max(float(stats["turns"].sum()), 1.0)}
    return metrics


class SingleTurn:
    """Today's rollout: one engine call, the response up to the end (what the trainer uses without tools)."""

    def generate(self, engine: Generator, prompts: Sequence[Sequence[int]], params: SamplingParams
                 ) -> list[Completion]:
        return engine.generate([list(p) for p in prompts], params)

    def close(self) -> None:
        pass


def make_rollout(cfg: Any, tokenizer: Any) -> SingleTurn | AgentLoop:
    """The trainer's rollout: ``engine.generate`` without tools, else an AgentLoop over ``cfg.agent.tools``; its
    ``close`` ends the tools' event loop (a call still running in its daemon thread is abandoned)."""
    if not cfg.agent.tools:
        return SingleTurn()
    return AgentLoop(cfg.agent, lambda text: tokenizer.encode(text, add_special_tokens=False),
                     lambda ids: tokenizer.decode(ids), cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens,
                     InertText.of(tokenizer))
