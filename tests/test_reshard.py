"""The resharder writes exactly the engine layout, for every trainer layout and rollout TP (CPU, gloo)."""


import pytest

from helpers import make_hf_model, run_worker


@pytest.mark.slow
def test_refit_equals_engine_layout_from_hf(tmp_path):
    # llama: 2 kv heads, so R=4 replicates kv heads; vocab 200 is not a multiple of 64 * R.
    llama = make_hf_model(tmp_path / "llama", "llama")
    # qwen2: QKV bias, tied embeddings, 4 kv heads so that TP=4 is possible.
    qwen2 = make_hf_model(tmp_path / "qwen2", "qwen2", num_attention_heads=8, num_key_value_heads=4,
                          hidden_size=128)
    # qwen3: QK-norm, head_dim 32 with hidden 64 (attention wider than the residual stream).
    qwen3 = make_hf_model(tmp_path / "qwen3", "qwen3")
    rows = run_worker("reshard.py", tmp_path, llama, qwen2, qwen3)
    regrouped = [r for r in rows if r.get("regrouped")]
    separate = [r for r in rows if r.get("separate")]
    rows = [r for r in rows if not r.get("separate") and not r.get("regrouped")]
    # A hand-over group whose ranks are not the world's (world ranks 1-3 as group ranks 0-2, as engine workers
    # outside a trainer's world would join one): the same exact, verified result, world rank 0 taking no part.
    assert sorted((r["model"], r["rank"], r["engine"]) for r in regrouped) == [
        (m, g, g > 0) for m in ("llama", "qwen2", "qwen3") for g in range(3)]
    assert all(r["exact"] and r["in_engine"] and r["verified"] for r in regrouped), regrouped
    receivers = {"in_place": True, "load": True}  # the engine worker's side (megarl.reshard.receiver), both ways in
    assert all(r["receiver"] == (receivers if r["engine"] else {}) for r in regrouped), regrouped
    # Engines on ranks of their own (async_rl separate): trainer meshes of 1-2 ranks, engines on the other 2-3, every
    # rollout TP dividing them. Each engine rank equals the reference, written by the resharder or by the engine's
    # own copy, verified by checksum, having received exactly its bytes; a trainer rank receives nothing.
    meshes = {(1, 1, 1): (1,), (2, 1, 1): (1, 2), (1, 2, 1): (1, 2), (1, 1, 2): (1, 2)}
    assert {(r["model"], r["tp"], r["pp"], r["dp"], r["R"]) for r in separate} == {
        (m, *mesh, R) for m in ("llama", "qwen2", "qwen3") for mesh, rs in meshes.items() for R in rs}
    for r in separate:
        assert r["exact"] and r["in_engine"] and r["verified"], r
        assert r["receiver"] == (receivers if r["engine"] else {}), r
        assert r["received"] == (r["needed"] if r["engine"] else 0), r
        assert r["engine"] == (r["rank"] >= r["tp"] * r["pp"] * r["dp"]), r
    assert max(r["rounds"] for r in separate) > 5
    layouts = {(r["model"], r["tp"], r["pp"], r["R"], r["dtype"]) for r in rows}
    expected = {(m, tp, pp, R, "torch.float32") for m in ("llama", "qwen3") for tp in (1, 2) for pp in (1, 2)
                for R in (1, 2, 4)}
    expected |= {("qwen2", tp, pp, R, "torch.float32") for tp in (1, 2, 4) for pp in (1, 2) if tp * pp <= 4
                 for R in (1, 2, 4)}
    expected |= {(m, 2, 2, R, "torch.bfloat16") for m in ("llama", "qwen2", "qwen3") for R in (1, 2, 4)}
    assert layouts == expected
    assert len(rows) == 4 * len(expected)
    for r in rows:
        assert r["exact"] and r["second_refit"] and r["pool_reused"] and r["in_engine"], r
        assert r["verified"] and r["corruption_caught"], r
    # Two GPUs per node: with R=1 both GPUs of a node need the bytes its shards lack (the tp-dp-pp order puts each
    # pipeline stage on its own nodes), which cross into the node once and are forwarded; with R=2 a node holds one
    # GPU of each engine rank, and R=4 spans nodes. In-engine, rounds begin with buckets forwarding what the round
    # before landed.
    for r in rows:
        assert r["relayed"] == 0 or r["R"] == 1, r
        assert r["relayed"] > 0 or (r["tp"], r["pp"], r["R"]) != (1, 2, 1), r
    assert max(r["relayed_at_round_start"] for r in rows) > 0
    # Small buckets force many of them (split tensors, several per layer) in the multi-GPU layouts.
    assert max(r["buckets"] for r in rows) > 10
    assert all(r["pool_bytes"] <= 4 * 48 * 1024 + 256 for r in rows)
    # In-engine mode within the same bound (two send buffers, a landing buffer of at most one bucket here), in as
    # many rounds as it takes; without a limit the landing buffer grows with what a GPU receives.
    for r in rows:
        assert r["in_engine_extra_bytes"] <= 3 * r["bucket_bytes"] + 256, r
    assert max(r["in_engine_rounds"] for r in rows) > 5
    assert max(r["unbounded_extra_bytes"] for r in rows) > 4 * 48 * 1024 + 256
    assert all(r["unbounded_rounds"] == 1 for r in rows)
    # rollout.alias_weights: every parameter an engine maps from the trainer's memory reads exactly what a copy
    # would have written, and after an update of the trainer, the new values, with no copy; the engine still
    # checksums it (a stale mapping would show), and the copy writes none of it.
    for r in rows:
        assert r["aliased_exact"] and r["aliased_checked"] and r["aliased_follow"], r
        assert r["aliased_verified"] and r["aliased_copied"] == [], r
    linear = ("o_proj.weight", "gate_up_proj.weight", "down_proj.weight")
    kv_heads = {"llama": 2, "qwen2": 4, "qwen3": 2}
    for r in rows:
        matched = r["tp"] == r["R"] and r["pp"] == 1
        mapped = [n for n in r["aliased"] if n.endswith(linear)]
        # With TP = R, those of the layers on this GPU's pipeline stage (4 layers), all of them at PP 1; else none.
        assert len(mapped) == (3 * 4 // r["pp"] if r["tp"] == r["R"] else 0), r
        # Megatron groups QKV per KV head: with TP = R the engine's [q; k; v] is the same run only with one KV head
        # per rank (elsewhere some engine ranks' q, k, v may happen to be one run).
        qkv = [n for n in r["aliased"] if n.endswith("qkv_proj.weight")]
        if matched:
            assert len(qkv) == (4 if kv_heads[r["model"]] == r["tp"] else 0), r


def _handover_group(tmp_path, model, engines_started: int, timeout_s: float) -> dict[str, object]:
    """Two trainer processes in a gloo world of their own (TP2) and ``engines_started`` of two engine workers in
    none, joined by the hand-over group: each process's rows (or error), by role_index."""
    import json
    import os
    import subprocess
    import sys

    from helpers import REPO, free_port

    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # free_port's port is free when asked, but another worker of the parallel suite can bind it before the group's
    # store does: that attempt (and only that) is made again on new ports.
    for _ in range(3):
        for f in tmp_path.glob("*_*.json"):
            f.unlink()
        ports = [str(free_port()), str(free_port())]
        procs = [subprocess.Popen([sys.executable, "tests/workers/handover_group.py", str(tmp_path), str(model),
                                   role, str(i), "2", "2", *ports, str(timeout_s)], cwd=REPO, env=env,
                                  stderr=subprocess.PIPE, text=True)
                 for role, i in [("trainer", 0), ("trainer", 1)] + [("engine", i) for i in range(engines_started)]]
        try:
            errs = [p.communicate(timeout=timeout_s + 300)[1] for p in procs]
        finally:
            for p in procs:
                p.kill()
        rows = {f.stem: json.loads(f.read_text()) for f in tmp_path.glob("*_*.json")}
        if not any("EADDRINUSE" in e for e in errs) \
                and "could not serve the meeting point" not in str(rows.get("trainer_0")):
            break
    for p, err in zip(procs, errs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return rows


def test_engine_workers_outside_the_trainers_world_receive_exactly_their_bytes(tmp_path):
    """async_rl separate with engines on GPUs of their own: engine workers are not in the trainer's torchrun world.
    Through the hand-over group, each engine GPU gets exactly its engine rank's tensors from the trainer's TP2 mesh,
    directly, in-engine and through the engine worker's receiver (megarl.reshard.receiver), equal to HF's slicing
    and verified by checksum over the group; the trainers send only, and their own world still works."""
    model = make_hf_model(tmp_path / "llama", "llama")
    out = tmp_path / "out"
    out.mkdir()
    # The join deadline is far above the time four processes take to import torch on a loaded machine: this test
    # checks the bytes, the next one the deadline.
    rows = _handover_group(out, model, engines_started=2, timeout_s=300)
    assert sorted(rows) == ["engine_0", "engine_1", "trainer_0", "trainer_1"]
    for name, part in rows.items():
        assert isinstance(part, list), (name, part)  # a member's error, as the worker wrote it
        assert [r["R"] for r in part] == [1, 2], name
        for r in part:
            assert r["exact"] and r["in_engine"] and r["verified"], (name, r)
            # the engine worker's receiver, into its parameters and into tensors of its own
            assert r["receiver"] == ({"in_place": True, "load": True} if r["engine"] else {}), (name, r)
            assert r["engine"] == name.startswith("engine") and (r["received"] > 0) == r["engine"], (name, r)
            assert r["src"] == (0 if r["engine"] else r["src"]) and (r["engine"] or r["src"] > 0), (name, r)
            assert name.startswith("engine") or r["world"] == 2, (name, r)


def test_an_engine_worker_that_never_joins_is_named_not_waited_for(tmp_path):
    """A push must not hang on an engine worker that never came: every member that did come stops after the
    timeout with an error naming the missing member."""
    model = make_hf_model(tmp_path / "llama", "llama")
    out = tmp_path / "out"
    out.mkdir()
    rows = _handover_group(out, model, engines_started=1, timeout_s=15)
    assert sorted(rows) == ["engine_0", "trainer_0", "trainer_1"]
    for name, part in rows.items():  # rank 0's verdict, which every member present reads before it goes
        assert "member(s) 3 did not join within 15 s" in part["error"], (name, part)


def test_a_taken_meeting_port_is_named_on_the_member_that_serves_it():
    """Member 0 serves the hand-over group's meeting point: when another process holds its port, it says so (and
    which port), not that it could not reach itself."""
    import socket

    from megarl.reshard.handover_group import HandoverGroupTimeout, handover_group

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(HandoverGroupTimeout, match=f"member 0 could not serve the meeting point.*port {port}"):
            handover_group(0, 2, "127.0.0.1", port, backend="gloo", timeout_s=3)
