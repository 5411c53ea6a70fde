"""Nothing damaged is resumed, nothing good is deleted: the manifest's checksums are checked before a resume,
``auto`` passes over damaged checkpoints, the rotation keeps what it must, a full disk is one paragraph.

Fast: checkpoint.save and checkpoint.find run in this process (a gloo world of one) on stand-in models whose
shards are small files; tests/test_checkpoint.py damages a real checkpoint end to end."""

from __future__ import annotations

import errno
import json
import os
import shutil
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import SafetensorError

from helpers import run_worker, zero_data
from megarl import checkpoint
from megarl.checkpoint import manifest, model_files, resuming, saving
from megarl.checkpoint.best_on_resume import check_best
from megarl.checkpoint.keep_best import best_step, mark_best
from megarl.distributed.parallel import ParallelDims
from megarl.errors import UserError


@pytest.fixture
def world(tmp_path, monkeypatch):
    """A process group of one rank, and checkpoint.save writing stand-in shards: the actor's weights and
    optimizer state as safetensors, common.pt as training writes them."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    from safetensors.torch import save_file

    def save_model(model, out):
        save_file({"w": torch.full((256,), float(model.step))}, str(out / "tp00_pp00.safetensors"))
        (out / "megarl_checkpoint.json").write_text("{}")
        return [out / "tp00_pp00.safetensors"]

    def save_optimizer(model, out):
        save_file({"w/exp_avg": torch.full((4096,), 0.5)}, str(out / "tp00_pp00_dp00.safetensors"))
        torch.save({"step": model.step, "scheduler": {}, "grad_scaler": None}, out / checkpoint.COMMON)
        return [out / "tp00_pp00_dp00.safetensors"]

    monkeypatch.setattr(model_files, "_save_weights", save_model)
    monkeypatch.setattr(model_files, "_save_optimizer", save_optimizer)
    monkeypatch.setattr(saving, "_rng_state", lambda: {"cpu": torch.get_rng_state()})
    yield tmp_path / "ckpt"
    dist.destroy_process_group()


def save(root: Path, step: int, keep_last: int = 5) -> Path:
    state = types.SimpleNamespace(step=step, groups=types.SimpleNamespace(dims=ParallelDims(tp=1, pp=1, dp=1)),
                                  optimizer=object(), parts=())
    model = types.SimpleNamespace(state=lambda: state)
    return checkpoint.save(str(root), step, {"actor": model}, {"loader": {}}, keep_last)


def test_the_manifest_lists_every_file_with_its_size_and_checksum(world):
    saved = save(world, 1)
    files = manifest.read(saved)
    on_disk = {p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file()} - {manifest.MANIFEST}
    assert set(files) == on_disk and {"trainer.json", "rank0.pt", "actor/optimizer/common.pt"} <= on_disk
    for name, entry in files.items():
        assert entry["bytes"] == (saved / name).stat().st_size
        assert entry["crc32"] == manifest.crc32(saved / name)
    assert checkpoint.verify(saved) is None


def test_each_rank_checks_about_the_same_number_of_bytes():
    files = {f"f{i}": {"bytes": size, "crc32": "0"} for i, size in enumerate([90, 50, 40, 30, 30, 10, 5, 5])}
    shares = [manifest.share(files, r, 3) for r in range(3)]
    assert sorted(n for s in shares for n in s) == sorted(files)  # each file once
    loads = [sum(files[n]["bytes"] for n in s) for s in shares]
    assert max(loads) - min(loads) <= 10, loads


@pytest.mark.parametrize("damage", ["optimizer data zeroed", "common.pt truncated", "rank0.pt truncated",
                                    "trainer.json truncated", "weights missing", "manifest truncated"])
def test_auto_resumes_from_the_newest_checkpoint_that_verifies_and_a_named_damaged_one_is_an_error(
        world, damage, capsys):
    good, bad = save(world, 2), save(world, 5)
    target = {"optimizer data zeroed": "actor/optimizer/tp00_pp00_dp00.safetensors",
              "common.pt truncated": "actor/optimizer/common.pt", "rank0.pt truncated": "rank0.pt",
              "trainer.json truncated": "trainer.json", "weights missing": "actor/tp00_pp00.safetensors",
              "manifest truncated": manifest.MANIFEST}[damage]
    if damage == "optimizer data zeroed":
        zero_data(bad / target)
    elif damage == "weights missing":
        (bad / target).unlink()
    else:
        (bad / target).write_bytes((bad / target).read_bytes()[:-7])
    with pytest.raises(UserError) as err:
        checkpoint.find(str(bad), str(world))
    assert str(bad / target) in str(err.value) and "checkpoint.resume: auto" in str(err.value)
    assert checkpoint.find("auto", str(world)) == good
    line = [x for x in capsys.readouterr().out.splitlines() if "instead of the damaged" in x]
    assert len(line) == 1 and "step_000005" in line[0] and str(bad / target) in line[0], line
    # The damaged one is kept aside: neither the next resume nor the rotation counts it.
    assert not bad.exists() and (world / "step_000005.damaged" / target).exists() == (damage != "weights missing")
    assert checkpoint.find("auto", str(world)) == good


def test_a_new_run_is_refused_a_directory_holding_another_runs_checkpoints(world, tmp_path):
    """checkpoint.resume: none into an earlier run's checkpoint.dir: the new run's rotation deleted the earlier
    run's checkpoints, keep_best could keep one of theirs as its best, and resume: auto could continue theirs."""
    save(world, 58)
    save(world, 59)
    with pytest.raises(UserError, match=r"holds 2 checkpoint\(s\) of an earlier one \(... step_000058, "
                                        r"step_000059\).*another checkpoint.dir"):
        checkpoint.find("none", str(world))
    empty = tmp_path / "fresh"
    assert checkpoint.find("none", str(empty)) is None and checkpoint.find("none", None) is None


def test_a_job_slurm_requeued_goes_on_from_its_newest_checkpoint_whatever_it_was_submitted_with(world, tmp_path,
                                                                                                  monkeypatch, capsys):
    """Slurm runs a requeued job with its submitted arguments: a checkpoint.resume naming a step started every
    requeue there again, and none was refused (or started from scratch). Before the job's first save its dir holds
    nothing: the submitted checkpoint still counts."""
    first, newest = save(world, 2), save(world, 5)
    other = tmp_path / "other_run"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert checkpoint.find(str(first), str(world)) == newest
    assert "requeued by Slurm (restart 1)" in capsys.readouterr().out
    assert checkpoint.find("none", str(world)) == newest
    assert checkpoint.find(str(first), str(other)) == first  # the new dir holds nothing yet
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert checkpoint.find(str(first), str(world)) == first


def test_auto_with_no_checkpoint_that_verifies_is_an_error_and_renames_nothing(world):
    only = save(world, 3)
    (only / "trainer.json").write_text("{")
    with pytest.raises(UserError, match="found no checkpoint in .* that verifies: step_000003: .*trainer.json"):
        checkpoint.find("auto", str(world))
    assert only.is_dir()


def test_a_checkpoint_without_a_manifest_resumes_with_a_line_saying_it_is_not_verified(world, capsys):
    """A legacy checkpoint (trainer.json records no manifest) resumes unverified, with a line; one whose
    trainer.json says it was saved with a manifest that is gone is damaged (its data may be zeroed too: the
    issue's run resumed from one as "legacy" and trained a destroyed model)."""
    older, newer = save(world, 1), save(world, 2)
    for step_dir in (older, newer):
        (step_dir / manifest.MANIFEST).unlink()
    trainer = json.loads((older / "trainer.json").read_text())
    assert trainer.pop("manifest") == manifest.VERSION
    (older / "trainer.json").write_text(json.dumps(trainer))
    assert checkpoint.find("auto", str(world)) == older
    out = capsys.readouterr().out
    assert "manifest.json is missing, though trainer.json says the checkpoint was saved with one" in out
    assert "has no manifest.json (saved by a megarl before checksums): its files are not verified" in out


def test_rotation_keeps_the_checkpoint_just_saved_and_the_newest_before_it(world):
    for step in (2, 5, 8):
        save(world, step)
    # Resumed from step 2 (say 5 and 8 were of a run the user abandoned): the checkpoint of step 3 is the
    # newest verified one, whatever keep_last says; it and `latest` must stay.
    saved = save(world, 3, keep_last=1)
    assert saved.is_dir() and (world / "latest").read_text() == "step_000003"
    assert checkpoint.find("auto", str(world)) == saved
    assert not (world / "step_000002").exists()  # keep_last 1: the one before goes
    assert (world / "step_000005").is_dir() and (world / "step_000008").is_dir()  # later steps: not this run's
    save(world, 4, keep_last=2)
    assert sorted(checkpoint.checkpoints(world)) == [3, 4, 5, 8]


def test_saving_a_step_again_replaces_its_checkpoint(world):
    save(world, 1)
    again = save(world, 1)
    assert checkpoint.verify(again) is None and not list(world.glob(".*"))


FULL = {  # how each writer reports a full disk (measured on a 1 MiB tmpfs)
    "open()": lambda path: OSError(errno.ENOSPC, "No space left on device", str(path)),
    "safetensors": lambda path: SafetensorError("Error while serializing: I/O error: No space left on device "
                                                "(os error 28)"),
    "torch.save": lambda path: RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
}


@pytest.mark.parametrize("writer", FULL)
@pytest.mark.parametrize("where", ["a rank's shard", "rank 0's manifest"])
def test_a_full_disk_during_a_save_is_one_paragraph_and_leaves_the_last_checkpoint(world, monkeypatch, where,
                                                                                    writer):
    good = save(world, 1)
    free = shutil.disk_usage(world)

    def full(out: Path, *args):
        # torch.save's message says nothing of the disk: the space left does (this one has 1 MiB).
        monkeypatch.setattr(shutil, "disk_usage", lambda path: free._replace(free=2**20))
        raise FULL[writer](out)

    if where == "a rank's shard":
        monkeypatch.setattr(model_files, "_save_optimizer", lambda model, out: full(out / "tp00_pp00_dp00.safetensors"))
    else:
        monkeypatch.setattr(manifest, "write", lambda root, files: full(root / manifest.MANIFEST))
    with pytest.raises(UserError) as err:
        save(world, 2)
    message = str(err.value)
    assert f"checkpoint.dir = {str(world)!r} is full" in message and "1.0 MiB of" in message
    assert f"the last checkpoint, {good.name}, took" in message
    assert not (world / ".step_000002.tmp").exists() and not (world / "step_000002").exists()
    assert (world / "latest").read_text() == good.name and checkpoint.verify(good) is None



def test_every_rank_reports_the_damage_one_rank_found(world, tmp_path):
    """Two ranks share the checking; the damaged file is in rank 1's share only. Both must stop alike (one
    paragraph, reported by rank 0) and fall back alike; neither may wait for the other."""
    good, bad = save(world, 2), save(world, 5)
    files = manifest.read(bad)
    target = manifest.share(files, 1, 2)[0]
    assert target not in manifest.share(files, 0, 2)
    (bad / target).write_bytes(b"\0" * (bad / target).stat().st_size)
    rows = run_worker("checkpoint_verify.py", tmp_path, world, bad, nproc=2)
    assert len(rows) == 2 and rows[0] == rows[1], rows
    assert rows[0]["explicit"].startswith("UserError: ") and str(bad / target) in rows[0]["explicit"]
    assert rows[0]["auto"] == str(good)


def test_every_file_and_directory_is_fsynced_before_the_rename_publishes_the_checkpoint(world, monkeypatch):
    events: list[tuple[str, Path]] = []
    fsync, replace = manifest.fsync_file, os.replace
    monkeypatch.setattr(manifest, "fsync_file", lambda path: (events.append(("fsync", Path(path))), fsync(path)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", Path(b))), replace(a, b)))
    saved = save(world, 1)
    tmp = world / ".step_000001.tmp"
    published = events.index(("rename", saved))
    synced = {path for kind, path in events[:published] if kind == "fsync"}
    expected = {tmp / p.relative_to(saved) for p in saved.rglob("*")} | {tmp}
    assert expected <= synced, sorted(expected - synced)
    assert ("fsync", world) in events[published:]  # the rename itself, and then `latest`'s
    assert events.index(("rename", world / "latest")) > published


def test_any_other_failure_during_a_save_is_raised_as_it_is_and_leaves_nothing_half_written(world, monkeypatch):
    good = save(world, 1)

    def broken(model, out):
        raise RuntimeError("a bug")

    monkeypatch.setattr(model_files, "_save_optimizer", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        save(world, 2)
    assert not (world / ".step_000002.tmp").exists() and (world / "latest").read_text() == good.name


BASE_CHECK = """
import json, sys, torch.distributed as dist
from pathlib import Path
from megarl.checkpoint import manifest
from megarl.errors import UserError
from megarl.lora.checkpoint import check_base_model

dist.init_process_group("gloo")
rank = dist.get_rank()
if rank > 0:  # only rank 0 may read the base's weights
    manifest.files_differ = lambda *a: (_ for _ in ()).throw(AssertionError(f"rank {rank} read the weights"))
verdicts = []
for base in sys.argv[2:]:
    try:
        check_base_model(Path(sys.argv[1]), base, rank)
        verdicts.append(None)
    except UserError as err:
        verdicts.append(str(err))
print(json.dumps(verdicts))
dist.destroy_process_group()
"""


def test_a_lora_resume_checksums_the_base_on_rank_0_alone_and_every_rank_refuses_alike(tmp_path):
    """A LoRA actor's base weights are checked against the checkpoint's record at a resume: rank 0 reads them
    (a 70B base is 140 GB: once, not once per rank) and every rank gets its verdict."""
    import subprocess
    import sys

    from helpers import REPO, free_port
    from megarl.checkpoint.manifest import weight_files

    base, other = tmp_path / "base", tmp_path / "other"
    base.mkdir()
    other.mkdir()
    (base / "model.safetensors").write_bytes(b"\0" * 4096)
    (other / "model.safetensors").write_bytes(b"\0" * 4095 + b"\1")
    record = tmp_path / "base_model.json"
    record.write_text(json.dumps(weight_files(str(base))))
    (tmp_path / "check.py").write_text(BASE_CHECK)
    env = os.environ | {"PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                        "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "check.py"), str(record), str(base), str(other)],
                              cwd=REPO, env=env | {"RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    verdicts = [json.loads(out) for out, _ in outs]
    assert verdicts[0] == verdicts[1]
    assert verdicts[0][0] is None
    assert "model.hf_path = " + str(other) in verdicts[0][1] and "model.safetensors" in verdicts[0][1]


@pytest.mark.parametrize("also_damaged", [False, True])
def test_a_damaged_best_gives_way_to_the_best_checkpoint_left_which_rotation_keeps(world, capsys, also_damaged):
    """The issue's run: keep_last 2, held-out accuracy 0.25 / 0.5 / 0.125 / 0.0625 / 0.875 over steps 0-4, the best
    (step 4) damaged, resumed. Step 1's 0.5, in metrics.jsonl, is the best left: the retrained step 4 (0.1875) must
    not take its place, nor rotation delete it. A best left that is itself damaged is set aside in its turn."""
    metric, scores = "eval/arith/accuracy", [0.25, 0.5, 0.125, 0.0625, 0.875]
    world.mkdir()
    with open(world / "metrics.jsonl", "w") as rows:
        for step, score in enumerate(scores):
            save(world, step, keep_last=2)
            mark_best(world, metric, step, {metric: score})
            rows.write(json.dumps({"step": step, "reward_mean": 0.1, metric: score}) + "\n")
    assert sorted(checkpoint.checkpoints(world)) == [1, 3, 4] and best_step(world) == 4
    zero_data(world / "step_000004" / "actor" / "tp00_pp00.safetensors")
    if also_damaged:
        zero_data(world / "step_000001" / "actor" / "tp00_pp00.safetensors")
    assert checkpoint.find("auto", str(world)) == world / "step_000003"
    check_best(world, metric, 4, 0)
    best, value = (3, 0.0625) if also_damaged else (1, 0.5)
    assert best_step(world) == best
    out = capsys.readouterr().out
    assert f"the best is now step {best} ({metric} = {value})" in out
    assert ("step_000001, the best left on eval/arith/accuracy (0.5), is damaged" in out) == also_damaged
    save(world, 4, keep_last=2)
    assert best in checkpoint.checkpoints(world)
    assert mark_best(world, metric, 4, {metric: 0.1875}) == (0.1875 > value)  # the retrained step 4


def test_with_keep_best_off_a_stale_best_is_set_aside_and_no_best_rebuilt(world, capsys):
    """A best.json left by an earlier run with keep_best on, its step gone: with keep_best now off it is set aside
    and nothing is rebuilt (a rebuilt record would spare its step from rotation forever)."""
    metric = "eval/arith/accuracy"
    world.mkdir()
    with open(world / "metrics.jsonl", "w") as rows:
        for step, score in enumerate([0.5, 0.25, 0.75]):
            save(world, step, keep_last=3)
            mark_best(world, metric, step, {metric: score})
            rows.write(json.dumps({"step": step, metric: score}) + "\n")
    assert best_step(world) == 2
    check_best(world, None, 2, 0)  # step 2 is trained again
    assert best_step(world) is None and (world / "best.json.stale").is_file()
    assert "checkpoint.keep_best is off, so no best is rebuilt" in capsys.readouterr().out


@pytest.mark.parametrize("pointer", ["", ".", "../elsewhere", "step_x"])
def test_a_latest_that_names_no_checkpoint_resumes_the_newest_that_verifies_and_renames_nothing_else(
        world, capsys, pointer):
    """A `latest` reading "" or "." made auto take checkpoint.dir itself for a damaged checkpoint and rename the
    whole directory *.damaged (metrics, lock and all): the next launch started again from step 0."""
    save(world, 1)
    newest = save(world, 2)
    (world / "metrics.jsonl").write_text('{"step": 2}\n')
    (world / "latest").write_text(pointer)
    assert checkpoint.find("auto", str(world)) == newest
    assert "not a checkpoint's name" in capsys.readouterr().out
    assert world.is_dir() and (world / "metrics.jsonl").is_file() and not world.with_name("ckpt.damaged").exists()
    (newest / "trainer.json").write_text("{")  # the newest damaged: only it is set aside
    assert checkpoint.find("auto", str(world)) == world / "step_000001"
    assert sorted(p.name for p in world.iterdir() if p.name.startswith("step")) == ["step_000001",
                                                                                    "step_000002.damaged"]
    assert resuming.set_aside(world) == "nothing: not a checkpoint's directory" and world.is_dir()


def test_a_failure_after_the_rename_names_the_saved_checkpoint_and_how_to_resume_from_it(world, monkeypatch, capsys):
    """The checkpoint is complete once renamed: a full disk while `latest` is pointed at it must not say that the
    partial checkpoint was removed; it names the checkpoint to resume from, and auto says that it leaves it alone."""
    save(world, 1)
    real = manifest.fsync_file

    def full(path):
        if Path(path).name == ".latest.tmp":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path)

    monkeypatch.setattr(manifest, "fsync_file", full)
    with pytest.raises(UserError) as err:
        save(world, 2)
    message = str(err.value)
    assert "step_000002 is saved and verifies, but pointing `latest` at it failed" in message
    assert "`latest` still names step_000001" in message and f"free space in {world}" in message
    assert f"checkpoint.resume: {world / 'step_000002'}" in message and "removed" not in message
    monkeypatch.setattr(manifest, "fsync_file", real)
    assert checkpoint.verify(world / "step_000002") is None
    capsys.readouterr()
    assert checkpoint.find("auto", str(world)) == world / "step_000001"
    assert "holds step_000002, later than `latest` (step_000001): left alone" in capsys.readouterr().out
    assert checkpoint.find(str(world / "step_000002"), str(world)) == world / "step_000002"


def test_a_new_best_lets_the_old_best_go_when_keep_last_does_not_hold_it(tmp_path, capsys):
    """keep_last 1 and keep_best: the last step's evaluation made it the best, and the former best, kept only as the
    best, stayed on disk for good (no save came after it to rotate it away)."""
    from megarl.eval.in_training import InTrainingEval

    for step in (79, 119):
        (tmp_path / f"step_{step:06d}").mkdir()
    mark_best(tmp_path, "eval/acc", 79, {"eval/acc": 0.5})
    evals = InTrainingEval.__new__(InTrainingEval)
    evals.best_metric, evals.keep_last, evals.rank, evals.out_dir = "eval/acc", 1, 0, tmp_path
    evals.keep_best(119, {"eval/acc": 0.75}, saved=True)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000119"] and best_step(tmp_path) == 119
    evals.keep_best(119, {"eval/acc": 0.25}, saved=True)  # no better: nothing moves
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000119"]


def test_a_step_evaluated_but_not_saved_is_never_the_best_whatever_step_n_is_on_disk(tmp_path):
    """A resume from an earlier checkpoint leaves the abandoned branch's later step_N: a step this run evaluated
    but did not save was recorded as the best with that other checkpoint, kept outside rotation for good."""
    from megarl.eval.in_training import InTrainingEval

    (tmp_path / "step_000009").mkdir()  # the other branch's
    evals = InTrainingEval.__new__(InTrainingEval)
    evals.best_metric, evals.keep_last, evals.rank, evals.out_dir = "eval/acc", 1, 0, tmp_path
    evals.keep_best(9, {"eval/acc": 0.9}, saved=False)
    assert best_step(tmp_path) is None
