"""The order of a hand-over on the trainer's side (WeightSync.push), with the engine, resharder and
offloading recorded: the engine only ever wakes into memory the trainer has given back to the driver, and the
actor's weights leave only after the engine let go of them."""

from types import SimpleNamespace

import pytest
import torch

from megarl.loop.learner import Learner
from megarl.loop.rollout_manager import RolloutManager
from megarl.loop.timing import PartTimes
from megarl.loop.trainer import RLTrainer
from megarl.loop.weight_sync import WeightSync


class Recorder:
    def __init__(self, events, name, copies_in_engine=True):
        self.events, self.name, self.copies_in_engine = events, name, copies_in_engine

    def __getattr__(self, method):
        def call(*args, **kwargs):
            shown = [a for a in args if isinstance(a, str | int)]
            self.events.append(f"{self.name}.{method}" + (f"({shown[0]})" if shown else ""))
        return call


def trainer_at_step(events, weights_leave):
    """A trainer after a training step: engine asleep, nothing attached."""
    times = PartTimes()
    rollout = object.__new__(RolloutManager)
    rollout.engine, rollout.state, rollout.partial, rollout.separate = Recorder(events, "engine"), "asleep", None, False
    learner = object.__new__(Learner)
    learner.actor = Recorder(events, "actor")  # refresh_merged: a LoRA actor's W + s B A
    learner.residency = SimpleNamespace(hold=lambda needs: events.append(f"hold({sorted(needs)})"))
    sync = object.__new__(WeightSync)
    sync.cfg = SimpleNamespace(rollout=SimpleNamespace(verify_every=0))
    sync.times, sync.attached, sync.weights_leave, sync.num_handovers = times, False, weights_leave, 1
    sync.resharder = Recorder(events, "resharder")
    sync.resharder.num_rounds = 2  # the landing buffer holds half of what this GPU receives
    sync.engine_tensors = None
    sync.adapters = None  # actor.lora.handover: merged (or no LoRA)
    sync.apart = 0  # the engine beside the trainer (async_rl.engine_gpus: 0)
    t = object.__new__(RLTrainer)
    t.rollout, t.learner, t.sync, t.times = rollout, learner, sync, times
    return t


@pytest.mark.parametrize("weights_leave", [True, False])
def test_the_engine_wakes_only_into_memory_given_back_to_the_driver(monkeypatch, weights_leave):
    events = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    t = trainer_at_step(events, weights_leave)
    t.push_weights()
    assert t.rollout.state == "awake"
    # Its parts are timed for the step's metrics (handover/*_s), verification off.
    parts = ("hold", "wake_weights", "attach", "copy", "release", "wake_cache")
    assert set(t.times.seconds) == {f"handover/{p}" for p in parts}
    wakes = [i for i, e in enumerate(events) if e.startswith("engine.wake")]
    assert [events[i] for i in wakes] == ["engine.wake(weights)", "engine.wake(cache)"]
    for i in wakes:  # the last thing before every wake: the trainer's freed and cached memory went back
        assert events[i - 1] == "empty_cache", events
    # Each round lands, then the engine copies it out, before the next round reuses the landing buffer.
    # A LoRA actor's merged weights are made before the first round reads them.
    handover = [e for e in events if e.startswith(("engine.attach", "actor.refresh", "resharder.refit",
                                                   "engine.deliver"))]
    assert handover == ["engine.attach", "actor.refresh_merged", "resharder.refit(0)", "engine.deliver(0)",
                        "resharder.refit(1)", "engine.deliver(1)"], events
    if weights_leave:  # the engine drops its mappings and the resharder its buffers before the weights leave
        assert events.index("engine.detach") < events.index("resharder.release") < wakes[1] - 2
    else:
        assert "engine.detach" not in events and "resharder.release" not in events


def test_an_adapter_handover_moves_the_adapters_alone(monkeypatch):
    """actor.lora.handover: adapter: the engine's weights wake and take the adapters; no merged weights are made
    and the resharder does not run."""
    events = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    t = trainer_at_step(events, weights_leave=False)
    t.sync.adapters = lambda: events.append("adapters")
    t.rollout.engine.copies_in_engine = False  # vLLM, the one engine that serves megarl's adapters
    t.push_weights()
    assert t.rollout.state == "awake"
    moved = [e for e in events if e.startswith(("engine.", "actor.", "resharder.", "adapters"))]
    assert moved == ["engine.wake(weights)", "adapters", "engine.wake(cache)"], events
