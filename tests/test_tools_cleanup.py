"""Host-side cleanup of a call that cannot fail: the working directory of an unsafe-none call goes whatever its
shape and permissions (a 1200-deep tree made rmtree raise RecursionError; a chmod 000 directory was skipped
silently for a trainer not running as root)."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from megarl.tools import reap
from megarl.tools.reap import remove_tree
from megarl.tools.sandbox import SandboxConfig, run_python

REPO = Path(__file__).resolve().parents[1]
DEEP_AND_LOCKED = ("import os\nfor i in range(1200):\n    os.mkdir('d')\n    os.chdir('d')\n"
                   "open('f', 'w').write('x')\nos.symlink('/etc', 'link')\nos.chdir('/'.join(['..'] * 600))\n"
                   "os.mkdir('locked')\nopen('locked/f', 'w').close()\nos.chmod('locked', 0)\nos.chmod('.', 0)\n"
                   "print('made')\n")


def test_an_unsafe_none_calls_directory_goes_however_deep_and_locked(tmp_path):
    result = run_python(DEEP_AND_LOCKED, SandboxConfig(isolation="unsafe-none", temp_root=str(tmp_path)))
    assert result.observation == "made" and os.listdir(tmp_path) == []
    assert os.path.isdir("/etc")  # the symlink was removed, not followed


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="needs root (to act as another, unprivileged user) and a python3 that user can run")
def test_a_tree_is_removed_by_its_unprivileged_owner_despite_chmod_000():
    base = tempfile.mkdtemp()  # pytest's tmp_path lies below a directory only root may enter
    try:
        os.chmod(base, 0o777)
        tree = os.path.join(base, "tree")
        script = (f"import importlib.util, os\nos.mkdir({tree!r})\nos.chdir({tree!r})\nexec({DEEP_AND_LOCKED!r})\n"
                  f"spec = importlib.util.spec_from_file_location('reap', {reap.__file__!r})\n"
                  "module = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(module)\n"
                  f"module.remove_tree({tree!r})\n")
        done = subprocess.run(["/usr/bin/python3", "-I", "-c", script], user=65534, group=65534, extra_groups=[],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout == "made\n", done.stderr
        assert not os.path.exists(tree)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_removal_never_follows_a_symlink_out(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    tree = tmp_path / "tree"
    (tree / "a").mkdir(parents=True)
    (tree / "a" / "out").symlink_to(outside)
    remove_tree(str(tree))
    assert not tree.exists() and (outside / "keep").exists()


ZOMBIES = """
import ctypes, os
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: as a trainer that is its container's PID 1
from megarl.tools.sandbox import SandboxConfig, run_python
codes = ["import time; time.sleep(100)", "print('hi')", "import os\\nwhile True: os.write(1, b'x' * 65536)"]
ends = [run_python(code, SandboxConfig(timeout_s=1, output_bytes=200)).end for code in codes]
zombies = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        continue
    if fields[0] == "Z" and int(fields[1]) == os.getpid():
        zombies.append(pid)
print(ends, len(zombies))
"""


def test_calls_that_time_out_leave_no_zombie_to_the_trainers_reaper():
    """A timed-out call killed bwrap before bwrap had reaped the sandbox's init: the init became a zombie of the
    nearest reaper, which no one collects where the trainer is its container's PID 1 (a run of infinite loops would
    fill the process table)."""
    proc = subprocess.run([sys.executable, "-c", ZOMBIES], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    ends, zombies = proc.stdout.rsplit(" ", 1)
    assert ends.count("timeout") == 2 and int(zombies) == 0, proc.stdout
