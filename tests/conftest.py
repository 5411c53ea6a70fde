"""Shared pytest hooks and fixtures: tests marked `gpu` are skipped on machines without CUDA; ``fake_sglang``
stands in for SGLang (which does not run on CPU) to check how megarl starts and calls it."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import signal
import sys
import types
from collections import Counter

import numpy as np
import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Files with the most slow tests first (each file's own order kept): pytest-xdist hands whole files to its
    # workers in this order, and a long file handed out last would run alone after the other worker is done.
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory):
    """One SQLite mlflow store for a module's cases: creating one costs seconds (mlflow's schema migrations)."""
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'store.db'}"


@pytest.fixture
def fake_sglang(monkeypatch):
    """An ``sglang`` module that records how the adapter starts and calls its engine: each generated sample gets
    tokens [5, 6] and routing whose every id is its sample index (SGLang's base64 int32 [tokens-1, layers, k])."""
    calls: dict = {}

    class Engine:
        def __init__(self, **kwargs):
            calls["start"] = kwargs
            self.loop = asyncio.new_event_loop()
            calls["aborted"] = []
            self.tokenizer_manager = types.SimpleNamespace(rid_to_state={}, abort_request=self.abort_request)

        async def async_generate(self, input_ids, sampling_params, return_logprob, rid, **kwargs):
            """One request decoding a token per pass of the loop (an engine step) until its budget or an abort,
            which it answers with the tokens it had, as SGLang does."""
            state = self.tokenizer_manager.rid_to_state[rid] = {"abort": False}
            tokens: list[int] = []
            while len(tokens) < sampling_params["max_new_tokens"] and not state["abort"]:
                await asyncio.sleep(0)
                tokens.append(5 + len(tokens) % 3)
            del self.tokenizer_manager.rid_to_state[rid]
            finish = "length" if len(tokens) == sampling_params["max_new_tokens"] else "abort"
            return {"output_ids": tokens, "meta_info": {"finish_reason": {"type": finish},
                                                        "output_token_logprobs": [(-0.5, t, None) for t in tokens]}}

        def abort_request(self, rid="", abort_all=False):
            calls["aborted"].append(rid)
            if rid in self.tokenizer_manager.rid_to_state:
                self.tokenizer_manager.rid_to_state[rid]["abort"] = True

        def shutdown(self):  # SGLang registers it with atexit; the adapter unregisters it
            calls["shutdown"] = True

        def get_server_info(self):
            return {"max_total_num_tokens": 1000}

        def generate(self, input_ids, sampling_params, return_logprob, **kwargs):
            calls["generate"] = kwargs
            layers, k = calls["shape"]
            return [{"output_ids": [5, 6], "meta_info": {
                "output_token_logprobs": [(-0.1, 5, None), (-0.2, 6, None)], "finish_reason": {"type": "length"},
                "routed_experts": base64.b64encode(np.full((len(p) + 1, layers, k), i, np.int32).tobytes()).decode()}}
                for i, p in enumerate(input_ids)]

    def install(*fields: str) -> dict:
        module = types.ModuleType("sglang")
        module.__version__, module.Engine = "0.0.test", Engine
        server_args = types.ModuleType("sglang.srt.server_args")
        server_args.ServerArgs = dataclasses.make_dataclass("ServerArgs", [(f, bool, False) for f in fields])
        for name, mod in (("sglang", module), ("sglang.srt", types.ModuleType("sglang.srt")),
                          ("sglang.srt.server_args", server_args)):
            monkeypatch.setitem(sys.modules, name, mod)
        return calls

    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGQUIT, signal.SIGTERM)}
    yield install
    for signum, handler in saved.items():  # the engine watch installs its own
        signal.signal(signum, handler)
