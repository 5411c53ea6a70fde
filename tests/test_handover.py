"""In-engine hand-over: the wire format, the engine-side copy and its errors (one process, CPU)."""

import pytest
import torch

from megarl.distributed.parallel import ParallelDims
from megarl.errors import UserError
from megarl.models.presets import preset_or_hf_spec
from megarl.reshard.executor import Resharder, engine_tensor_allocations
from megarl.reshard.handover import HandoverState, apply_message, checksum_message, detach_message
from megarl.reshard.planner import make_plan

TINY = preset_or_hf_spec("tiny")  # vocab 1000: the engine's vocab rows past it are padding


class FakeEngineModel:
    """What the loader sees of an engine's model: named parameters."""

    def __init__(self, params):
        self.params = params

    def named_parameters(self):
        return iter(self.params.items())


def _setup():
    plan = make_plan(TINY, ParallelDims(tp=1, pp=1, dp=1), 1, element_size=4)
    src = {name: torch.randn(shape) for name, shape in plan.src_shapes.items()}
    expected = engine_tensor_allocations(plan, 0, torch.float32, torch.device("cpu"))
    Resharder(plan, 0, src, expected).refit()
    params = engine_tensor_allocations(plan, 0, torch.float32, torch.device("cpu"))
    return plan, src, expected, params


def test_attach_then_apply_writes_engine_parameters_and_rewrites_after_a_sleep():
    plan, src, expected, params = _setup()
    model, state = FakeEngineModel(params), HandoverState()
    resharder = Resharder(plan, 0, src, None, in_engine=True)
    state.handle(model, resharder.engine_copy().to_wire("k"))
    for p in params.values():
        p.fill_(float("nan"))  # an engine's memory after a sleep holds no defined values
    resharder.refit()
    state.handle(model, apply_message("k", torch.zeros(1)))
    for name, want in expected.items():
        assert torch.equal(params[name], want), name
    assert params["model.embed_tokens.weight"].shape[0] > TINY.vocab_size  # padding rows were checked too
    for t in src.values():
        t.mul_(3)
    state.handle(model, apply_message("k", torch.zeros(1)))
    for name, want in expected.items():
        assert torch.equal(params[name], want * 3), name


def test_engine_side_errors_name_the_problem():
    plan, src, _, params = _setup()
    copy = Resharder(plan, 0, src, None, in_engine=True).engine_copy()
    state = HandoverState()
    with pytest.raises(ValueError, match="no megarl attachment `k`"):
        state.handle(FakeEngineModel(params), apply_message("k", torch.zeros(1)))
    missing = dict(params)
    del missing["model.norm.weight"]
    with pytest.raises(ValueError, match="no parameter `model.norm.weight`"):
        state.handle(FakeEngineModel(missing), copy.to_wire("k"))
    bad = dict(params, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"model.norm.weight` is \[3\]"):
        state.handle(FakeEngineModel(bad), copy.to_wire("k"))
    with pytest.raises(ValueError, match="not a megarl hand-over message"):
        state.handle(FakeEngineModel(params), [("model.norm.weight", torch.zeros(1))])
    state.handle(FakeEngineModel(params), copy.to_wire("k"))
    with pytest.raises(ValueError, match="hand-over round 1 requested; this attachment has 1"):
        state.handle(FakeEngineModel(params), apply_message("k", torch.zeros(1), 1))


def test_an_engine_parameter_the_hand_over_never_writes_is_refused_by_name():
    """A parameter outside megarl's engine layout (a family or engine version it does not know) would keep the
    engine's starting weights while the actor trains, with every checksum of the written ones green."""
    plan, src, _, params = _setup()
    copy = Resharder(plan, 0, src, None, in_engine=True).engine_copy()
    extra = dict(params, **{"model.layers.0.self_attn.o_proj.bias": torch.zeros(TINY.hidden_size)})
    with pytest.raises(ValueError, match=r"1 parameters the hand-over never writes \(\['model.layers.0.self_attn"
                                         r".o_proj.bias'\]\): they would keep the engine's starting weights"):
        HandoverState().handle(FakeEngineModel(extra), copy.to_wire("k"))
    HandoverState().handle(FakeEngineModel(params), copy.to_wire("k"))


def test_an_engine_in_another_dtype_of_the_same_size_is_refused_by_name():
    """bf16 bits read as fp16 are other numbers while every checksum of the raw bits agrees: both sides refuse."""
    plan = make_plan(TINY, ParallelDims(tp=1, pp=1, dp=1), 1, element_size=2)
    src = {name: torch.randn(shape).bfloat16() for name, shape in plan.src_shapes.items()}
    params = engine_tensor_allocations(plan, 0, torch.float16, torch.device("cpu"))
    copy = Resharder(plan, 0, src, None, in_engine=True).engine_copy()
    assert copy.dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"engine parameter `.*` is float16, but the trainer hands over bfloat16"):
        HandoverState().handle(FakeEngineModel(params), copy.to_wire("k"))
    with pytest.raises(UserError, match=r"engine, rank 0: tensor `.*` is torch.float16, but the trainer hands over"):
        Resharder(plan, 0, src, params)
    mixed = dict(src, **{"decoder.final_layernorm.weight": src["decoder.final_layernorm.weight"].half()})
    with pytest.raises(UserError, match=r"mix dtypes \['torch.bfloat16', 'torch.float16'\]"):
        Resharder(plan, 0, mixed, None, in_engine=True)
    HandoverState().handle(FakeEngineModel(engine_tensor_allocations(plan, 0, torch.bfloat16, torch.device("cpu"))),
                           copy.to_wire("k"))


def test_engine_ranks_read_their_own_entries_of_padded_payloads():
    """An engine over R GPUs takes the same names from every rank: ranks with fewer trainer tensors pad
    theirs (to_wire num_sources), and each engine rank unpacks only its own entries."""
    plan, src, expected, params = _setup()
    copy = Resharder(plan, 0, src, None, in_engine=True).engine_copy()
    padded = copy.to_wire("k", num_sources=len(copy.sources) + 3)
    assert len(padded) == len(copy.to_wire("k")) + 3
    state = HandoverState()
    state.handle(FakeEngineModel(params), padded)
    state.handle(FakeEngineModel(params), apply_message("k", torch.zeros(1)))
    assert all(torch.equal(params[n], expected[n]) for n in expected)
    assert len(state.appliers["k"].sources) == len(copy.sources)  # the placeholders were dropped


def test_an_engine_parameter_offloaded_after_attaching_is_refused_by_its_name():
    """An engine that frees a parameter's memory (resize_(0)) after the copy was compiled: the replay and the checksum
    refuse by the parameter's name instead of writing or reading freed memory."""
    plan, src, _, params = _setup()
    state = HandoverState()
    state.handle(FakeEngineModel(params), Resharder(plan, 0, src, None, in_engine=True).engine_copy().to_wire("k"))
    params["model.norm.weight"].untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        state.handle(FakeEngineModel(params), apply_message("k", torch.zeros(1)))
    result = torch.zeros(len(state.appliers["k"].params), 2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        state.handle(FakeEngineModel(params), checksum_message("k", result))


def test_an_engine_parameter_given_new_memory_after_attaching_is_refused_by_its_name():
    """param.data = ...: the compiled copy still points at the old memory, which it would fill while the engine reads
    the new one (its starting weights, every step)."""
    plan, src, _, params = _setup()
    state = HandoverState()
    state.handle(FakeEngineModel(params), Resharder(plan, 0, src, None, in_engine=True).engine_copy().to_wire("k"))
    params["model.norm.weight"].data = torch.zeros_like(params["model.norm.weight"])
    with pytest.raises(RuntimeError, match="`model.norm.weight` was replaced or given other memory"):
        state.handle(FakeEngineModel(params), apply_message("k", torch.zeros(1)))


def test_an_engine_parameter_replaced_by_a_new_one_after_attaching_is_refused_by_its_name():
    """module.weight = Parameter(...): the old object keeps its memory, so only the name tells."""
    plan, src, _, params = _setup()
    state = HandoverState()
    state.handle(FakeEngineModel(params), Resharder(plan, 0, src, None, in_engine=True).engine_copy().to_wire("k"))
    params = params | {"model.norm.weight": torch.zeros_like(params["model.norm.weight"])}
    with pytest.raises(RuntimeError, match="`model.norm.weight` was replaced or given other memory"):
        state.handle(FakeEngineModel(params), apply_message("k", torch.zeros(1)))


def _flat_views(shapes):
    """Tensors viewing one flat buffer, as Megatron's DDP parameters view its parameter buffer."""
    sizes = {name: torch.Size(shape).numel() for name, shape in shapes.items()}
    flat = torch.randn(sum(sizes.values()))
    views, offset = {}, 0
    for name, shape in shapes.items():
        views[name] = flat[offset:offset + sizes[name]].view(shape)
        offset += sizes[name]
    return flat, views


def _move(flat: torch.Tensor) -> list[torch.Tensor]:
    """What megarl.memory.offload does to the actor's weights during rollout: the storage is freed and comes back
    elsewhere, with the same tensors viewing it. Returns what holds the old address meanwhile."""
    storage, saved = flat.untyped_storage(), flat.clone()
    before = flat.data_ptr()
    storage.resize_(0)
    # Allocations of the same size until one takes the freed memory, so the buffer must come back elsewhere: the
    # first does not always (glibc raises its mmap threshold when an mmapped block is freed; CI saw the address back).
    squatters = [torch.empty_like(saved)]
    while squatters[-1].data_ptr() != before and len(squatters) < 64:
        squatters.append(torch.empty_like(saved))
    storage.resize_(saved.numel() * saved.element_size())
    flat.copy_(saved)
    assert flat.data_ptr() != before
    return squatters


@pytest.mark.parametrize("in_engine", [False, True])
def test_weights_that_leave_the_device_are_handed_over_from_where_they_come_back(in_engine):
    """actor.offload_weights: after each hand-over the resharder lets go of every address (``release``) and
    the engine of its mappings (detach); the weights come back at other addresses (and engine-layout tensors
    are new), and the next refit, bound and attached again, reads and writes them there."""
    plan, _, _, params = _setup()
    flat, src = _flat_views(plan.src_shapes)
    expected = engine_tensor_allocations(plan, 0, torch.float32, torch.device("cpu"))
    dst = None if in_engine else engine_tensor_allocations(plan, 0, torch.float32, torch.device("cpu"))
    resharder = Resharder(plan, 0, src, dst, in_engine=in_engine)
    model, state = FakeEngineModel(params), HandoverState()
    for update in range(2):
        if in_engine:
            state.handle(model, resharder.engine_copy().to_wire("actor"))
        resharder.refit()
        if in_engine:
            state.handle(model, apply_message("actor", torch.zeros(1)))
            state.handle(model, detach_message("actor", torch.zeros(1)))
            assert not state.appliers  # the engine no longer maps the trainer's tensors
        Resharder(plan, 0, src, expected).refit()  # a fresh resharder: the reference
        for name, want in expected.items():
            assert torch.equal((params if in_engine else dst)[name], want), (update, name)
        resharder.release()
        assert resharder.landing is None and resharder.pool is None
        squatters = _move(flat)
        flat.mul_(-2)  # the next update
        if dst is not None:  # vLLM: the engine-layout tensors are freed during rollout and allocated anew,
            dst.update(engine_tensor_allocations(plan, 0, torch.float32, torch.device("cpu")))
            for t in dst.values():
                t.fill_(float("nan"))  # whose vocab padding the resharder never sends: it must zero it
    if in_engine:
        with pytest.raises(ValueError, match="no megarl attachment `actor`"):
            state.handle(model, apply_message("actor", torch.zeros(1)))
    del squatters


def test_the_engine_reports_checksums_that_match_the_trainers_and_catch_a_corrupted_tensor():
    """rollout.verify_every: the engine rank checksums its parameters after an apply; they equal what the
    trainer computes from its own tensors and the plan, and a parameter changed afterwards is named."""
    from megarl.reshard.verify import engine_names, mismatched

    plan, src, _, params = _setup()
    model, state = FakeEngineModel(params), HandoverState()
    resharder = Resharder(plan, 0, src, None, in_engine=True)
    state.handle(model, resharder.engine_copy().to_wire("k"))
    resharder.refit()
    state.handle(model, apply_message("k", torch.zeros(1)))
    names = resharder.dst_names
    assert names == engine_names(plan)[0] and len(names) == len(params)
    reported = torch.full((len(names), 2), -1, dtype=torch.int64)
    state.handle(model, checksum_message("k", reported))
    expected = resharder.expected_checksums()
    assert torch.equal(reported, expected) and (reported >= 0).all()
    assert mismatched(names, expected, reported) == []
    # Two rows swapped: the same values, in the wrong place.
    qkv = params["model.layers.1.self_attn.qkv_proj.weight"]
    qkv[[0, 1]] = qkv[[1, 0]]
    params["model.norm.weight"][3] += 1
    state.handle(model, checksum_message("k", reported))
    assert mismatched(names, expected, reported) == ["model.layers.1.self_attn.qkv_proj.weight",
                                                     "model.norm.weight"]
    with pytest.raises(ValueError, match="no megarl attachment `other`"):
        state.handle(model, checksum_message("other", reported))
    with pytest.raises(ValueError, match="checksum request for 2 parameters"):
        state.handle(model, checksum_message("k", torch.zeros(2, 2, dtype=torch.int64)))
