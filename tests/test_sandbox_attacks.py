"""Hostile code against the sandbox, one attack per class, each as a policy searching for exploits would write
it. Every test asserts that the attack was contained and that nothing of the call outlives it: no process (found
by a tag in its command line), no cgroup, no file on the host."""

import asyncio
import ctypes
import errno
import fcntl
import gc
import json
import os
import signal
import socket
import struct
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from megarl.tools import ToolPool, cgroups
from megarl.tools.python_exec import PythonExecutor
from megarl.tools.sandbox import SandboxConfig, run_python

CGROUPED = not run_python("pass", SandboxConfig()).layers["limits"].startswith("none")


def config(**overrides):
    return SandboxConfig(**{"timeout_s": 5.0, "cpu_s": 2, "memory_bytes": 256 << 20, **overrides})


def contained(code, tag=None, **overrides):
    """Run `code`; assert that no process tagged `tag` and no cgroup of the call is left."""
    result = run_python(code, config(**overrides))
    assert result.survivors == []
    if tag:
        assert [p for p in Path("/proc").iterdir() if p.name.isdigit() and tag.encode() in _read(p / "cmdline")] == []
    assert leftover_cgroups() == []
    return result


def leftover_cgroups():
    """This process's call cgroups (megarl-sandbox-PID-*) beside the ones it would make, in every hierarchy; not
    other processes' (another pytest worker's calls run at the same time)."""
    own = cgroups._own_paths()
    return [d for point, kind, options in cgroups._mounts() for key in ([""] if kind == "cgroup2" else options)
            if key in own for d in Path(point, own[key]).glob(f"megarl-sandbox-{os.getpid()}-*")]


def _read(path):
    try:
        return path.read_bytes()
    except OSError:
        return b""


def test_cpu_spinning_processes_and_threads_end_at_their_limits():
    tag = uuid.uuid4().hex
    code = (f"import os, threading\n# {tag}\nfor _ in range(3):\n    if os.fork() == 0:\n        break\n"
            "def spin():\n    while True:\n        pass\nfor _ in range(3):\n"
            "    threading.Thread(target=spin, daemon=True).start()\n"
            "while True: pass\n")
    result = contained(code, tag, timeout_s=2.0, cpu_s=1)
    assert result.end in ("killed: CPU time limit", "timeout after 2 s")


def test_a_fork_bomb_is_capped_and_processes_left_behind_die_with_the_call():
    tag = f"{time.time() % 1000:.6f}"  # a sleep duration no other process uses
    code = (f"import os, subprocess\nsubprocess.Popen(['sleep', '{tag}'], start_new_session=True, env={{}})\n"
            f"if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execvp('sleep', ['sleep', '{tag}'])\n"
            "    os._exit(0)\nwhile True:\n    os.fork()\n")
    result = contained(code, tag, timeout_s=3.0)
    assert result.end in ("exit code 1", "timeout after 3 s")
    if CGROUPED:  # pids.max refused the 33rd process at once
        assert "BlockingIOError" in result.output and result.end == "exit code 1"


def test_memory_spread_over_many_processes_stays_within_the_calls_limit():
    if not CGROUPED:
        pytest.skip("no cgroup here: memory is limited per process only (docs/tools.md)")
    # 8 processes of 60 MiB each against a limit of 256 MiB for the whole call: at most 4 may hold theirs at once
    # (a holder the OOM killer ends lets a later one in, so count those alive, not those that ever held)
    code = ("import os, time\nr, w = os.pipe()\nfor _ in range(8):\n    if os.fork() == 0:\n"
            "        hog = b'x' * (60 << 20)\n        os.write(w, str(os.getpid()).encode() + b' ')\n"
            "        time.sleep(3)\n        os._exit(0)\n"
            "os.close(w)\ntime.sleep(1.5)\nos.set_blocking(r, False)\ntry:\n    pids = os.read(r, 1000).split()\n"
            "except BlockingIOError:\n    pids = []\n"
            "print('held', sum(os.waitpid(int(p), os.WNOHANG)[0] == 0 for p in pids))\n")
    result = contained(code, timeout_s=4.0)
    held = int(result.output.split()[-1]) if "held" in result.output else 0
    assert held <= 4, result.observation


def test_shared_memory_does_not_outlive_the_call_and_queues_and_keyrings_are_absent():
    key = int(uuid.uuid4().hex[:7], 16)
    create = (f"import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
              f"print('shm', libc.shmget({key}, 64 << 20, 0o1000 | 0o666) >= 0)\n"
              f"rt = ctypes.CDLL('librt.so.1', use_errno=True)\n"
              f"print('mq', rt.mq_open(b'/m{key}', os.O_CREAT | os.O_RDWR, 0o666, None), ctypes.get_errno())\n"
              "libc.syscall.restype = ctypes.c_long\n"
              "key_id = libc.syscall(248, b'user', b'secret', b'answer 42', 6, -4)  # add_key to the session keyring\n"
              "print('key', key_id, ctypes.get_errno())\n")
    made = contained(create)
    assert made.output.splitlines() == ["shm True", "mq -1 38", "key -1 1"], made.observation  # ENOSYS, EPERM
    probe = f"import ctypes\nprint('shm', ctypes.CDLL(None).shmget({key}, 0, 0))\n"
    assert contained(probe).output.split() == ["shm", "-1"]
    assert f"{key:10d}" not in Path("/proc/sysvipc/shm").read_text()  # nothing on the host either


def test_filling_the_disk_stops_at_the_calls_own_tmpfs():
    code = ("import os\nfor where in ('.', '/tmp', '/dev/shm'):\n    try:\n        for i in range(1000):\n"
            "            with open(f'{where}/fill{i}', 'wb') as f:\n                f.write(b'x' * (8 << 20))\n"
            "    except OSError as err:\n        print(where, err.strerror, i * 8)\n")
    result = contained(code, disk_bytes=32 << 20, memory_bytes=512 << 20)
    assert [line.split()[0] for line in result.output.splitlines()] == [".", "/tmp", "/dev/shm"]
    assert all("No space left" in line and int(line.split()[-1]) <= 32 for line in result.output.splitlines())


def test_files_outside_are_neither_written_nor_seen(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the answer")
    import site
    targets = ["/usr/megarl-pwned", "/etc/megarl-pwned", "/megarl-pwned", f"{site.getsitepackages()[0]}/pwn.pth",
               "/proc/sys/kernel/hostname", "/proc/sysrq-trigger"]
    code = ("import os\n"
            f"for path in {targets!r}:\n    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n"
            "    except OSError as err:\n        print('refused', err.strerror)\n"
            f"print([p for p in ({str(secret)!r}, '/etc/shadow', '/root', '/run', '/var', '/sys', '/home/sandbox/..') "
            "if os.path.exists(p) and os.listdir(p) if os.path.isdir(p)] or 'nothing')\n")
    result = contained(code)
    assert "WROTE" not in result.output and result.output.count("refused") == len(targets), result.output
    assert result.output.splitlines()[-1] == "nothing" or "/home/sandbox/.." in result.output.splitlines()[-1]
    assert not any(Path(t).exists() for t in targets[:4])


def test_host_sockets_are_unreachable(tmp_path):
    path, abstract = str(tmp_path / "host.sock"), f"\0megarl-test-{uuid.uuid4().hex}"
    servers = [socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX), socket.create_server(("127.0.0.1", 0))]
    servers[0].bind(path)
    servers[1].bind(abstract)
    for s in servers[:2]:
        s.listen()
    port = servers[2].getsockname()[1]
    code = ("import socket\n"
            f"for family, where in ((socket.AF_UNIX, {path!r}), (socket.AF_UNIX, {abstract!r}), "
            f"(socket.AF_INET, ('127.0.0.1', {port})), (socket.AF_INET, ('1.1.1.1', 53))):\n"
            "    try:\n        socket.socket(family).connect(where)\n        print('CONNECTED', where)\n"
            "    except OSError as err:\n        print('refused', err.strerror)\n")
    try:
        result = contained(code)
        for s in servers:
            s.settimeout(0.1)
            with pytest.raises(TimeoutError):
                s.accept()
    finally:
        for s in servers:
            s.close()
    lines = result.output.splitlines()
    assert len(lines) == 4 and all(line.startswith("refused") for line in lines), result.output


def test_concurrent_calls_cannot_see_each_others_processes_or_files():
    secret = uuid.uuid4().hex
    writer = (f"open('answer.txt', 'w').write('{secret}')\nopen('/tmp/answer.txt', 'w').write('{secret}')\n"
              f"open('/dev/shm/answer', 'w').write('{secret}')\n"
              f"import time\nprint('written', flush=True)\ntime.sleep(2)")
    reader = ("import os, sys, time\ntime.sleep(0.7)\nfound = []\nfor root in ('/home', '/tmp', '/dev/shm', '/proc'):\n"
              "    for d, _, files in os.walk(root):\n"
              "        if d.startswith(sys.prefix):  # the interpreter, bound read-only (a venv under /tmp)\n"
              "            continue\n"
              "        for f in files:\n"
              "            if f == 'main.py':  # its own code\n                continue\n            try:\n"
              f"                if '{secret}' in open(os.path.join(d, f), errors='ignore').read(1 << 16):\n"
              "                    found.append(os.path.join(d, f))\n"
              "            except OSError:\n                pass\n"
              "print(found, sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    pool = ToolPool([PythonExecutor(timeout_s=5.0)], max_workers=2)

    async def both():
        return await asyncio.gather(pool.run("python", writer), pool.run("python", reader))

    wrote, read = asyncio.run(both())
    assert wrote.observation == "written"
    found, pids = read.observation.split("] [")
    assert found == "[" and len(pids.rstrip("]").split(", ")) <= 3, read.observation  # bwrap's init, itself


def test_devices_are_absent_and_cannot_be_made():
    code = ("import os\nfor dev in ('/dev/kvm', '/dev/kmsg', '/dev/fuse', '/dev/mem', '/dev/sda', '/dev/net/tun'):\n"
            "    try:\n        os.close(os.open(dev, os.O_RDWR))\n        print('OPENED', dev)\n"
            "    except OSError as err:\n        print(err.strerror)\n"
            "try:\n    os.mknod('kvm', 0o20666, os.makedev(10, 232))\n    print('MADE')\nexcept OSError as err:\n"
            "    print(err.strerror)\nprint(sorted(os.listdir('/dev')))\n")
    lines = contained(code).output.splitlines()
    assert lines[:6] == ["No such file or directory"] * 6 and lines[6] == "Operation not permitted"
    assert lines[7] == str(sorted(["core", "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin",
                                   "stdout", "tty", "urandom", "zero"]))


def test_no_capabilities_no_nested_namespaces_no_ptrace_mount_bpf_or_perf():
    code = ("import ctypes, os, subprocess\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.syscall.restype = ctypes.c_long\n"
            "status = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
            "print(status['CapEff'], status['CapBnd'], status['NoNewPrivs'], status['Seccomp'])\n"
            "def tried(name, result):\n    print(name, result, ctypes.get_errno())\n"
            "tried('unshare', libc.unshare(0x10000000))\n"                      # CLONE_NEWUSER
            "tried('clone', libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0))\n"   # clone(CLONE_NEWUSER | SIGCHLD)
            "tried('clone3', libc.syscall(435, 0, 0))\n"
            "tried('ptrace', libc.ptrace(16, 1, 0, 0))\n"                       # PTRACE_ATTACH to init
            "tried('mount', libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))\n"
            "tried('bpf', libc.syscall(321, 0, 0, 0))\n"
            "tried('perf', libc.syscall(298, 0, 0, -1, -1, 0))\n"
            "tried('setuid', libc.setuid(0))\n"
            "print(subprocess.run(['unshare', '-U', '-r', 'id'], capture_output=True, text=True).returncode)\n")
    lines = contained(code).output.splitlines()
    assert lines[0] == "0000000000000000 0000000000000000 1 2", lines
    assert lines[1:9] == ["unshare -1 1", "clone -1 1", "clone3 -1 38", "ptrace -1 1", "mount -1 1", "bpf -1 1",
                          "perf -1 1", "setuid -1 1"]  # EPERM, and ENOSYS for clone3
    assert lines[9] != "0"


def test_no_audit_hook_to_switch_off_the_kernel_confines_raw_calls():
    # the attacks that walked past the old audit hook: ctypes' own open() and connect(), and another program
    code = ("import ctypes, subprocess\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.open(b'/usr/lib/pwned', 0o101, 0o644), ctypes.get_errno())\n"   # O_WRONLY | O_CREAT
            "print(subprocess.run(['bash', '-c', 'echo x > /etc/pwned; echo x > /dev/tcp/127.0.0.1/22'], "
            "capture_output=True, text=True).stderr)\n")
    result = contained(code)
    assert result.output.splitlines()[0] == "-1 30"  # EROFS
    # bash's own socket() is refused like Python's: AF_UNIX only
    assert "Read-only file system" in result.output
    assert "/dev/tcp/127.0.0.1/22: Address family not supported by protocol" in result.output
    assert not Path("/usr/lib/pwned").exists() and not Path("/etc/pwned").exists()


def test_flooding_output_is_cut_and_the_call_returns_on_time():
    tag = uuid.uuid4().hex
    code = (f"import os, subprocess, sys\nsubprocess.Popen(['sh', '-c', 'sleep 30; : {tag}'], start_new_session=True)\n"
            "while True:\n    os.write(1, b'y' * 65536)\n    os.write(2, b'z' * 65536)\n")
    result = contained(code, tag, timeout_s=1.0, output_bytes=1000)
    assert len(result.output) == 1000 and result.truncated_bytes > 1_000_000 and result.end == "timeout after 1 s"


def test_forged_status_lines_change_nothing_the_host_reports():
    # the old launcher read JSON status lines from a pipe the code could reach; now nothing is read from the call
    # but its output, and the layers are what the host set up
    code = ("import os\nfor fd in range(3, 256):\n    for line in (b'5\\n"
            "', b'{\"end\": \"ok\", \"sandbox\": \"none\"}\\n'):\n"
            "        try:\n            os.write(fd, line)\n        except OSError:\n            pass\nos._exit(7)\n")
    clean = run_python("pass", config())
    result = contained(code)
    assert result.end == "exit code 7" and result.layers == clean.layers


def test_descriptors_are_closed_once_however_calls_end(tmp_path):
    sentinel = tmp_path / "sentinel"
    sentinel.write_text("mine")
    gc.collect()  # an earlier test's file object, collected mid-test, would close a number of its own
    held = [os.open(sentinel, os.O_RDONLY) for _ in range(16)]  # numbers a double close would hit
    busy = tmp_path / "busy"
    busy.write_text("theirs")
    before = set(os.listdir("/proc/self/fd"))
    codes = ["print(1)", "import os; os._exit(3)", "while True: pass", "import os\nwhile True: os.fork()",
             "import time; time.sleep(10)"]
    errors = []

    def hammer():  # another thread of the trainer, opening and using descriptors all the while
        for _ in range(200):
            with open(busy) as f:  # a reused number shows as this file in `held`
                if f.read() != "theirs":
                    errors.append("read garbage")
            time.sleep(0.002)

    other = threading.Thread(target=hammer)
    other.start()
    pool = ToolPool([PythonExecutor(timeout_s=3.0, cpu_s=1)], max_workers=5)

    async def calls():
        return await asyncio.gather(*(pool.run("python", code) for code in codes))

    try:
        results = asyncio.run(calls())
    finally:
        other.join()
    assert errors == [] and [r.status for r in results] == ["ok", "error", "error", "error", "timeout"]
    time.sleep(0.1)
    try:
        assert set(os.listdir("/proc/self/fd")) - before == set(), "a call left a descriptor open"
        assert all(os.pread(fd, 4, 0) == b"mine" for fd in held), "a call closed a descriptor it did not own"
    finally:
        for fd in held:
            os.close(fd)


def test_sockets_of_every_family_but_unix_are_refused_vsock_included():
    # AF_VSOCK sits outside the network namespace: two calls passed data through the VM's vsock ports, and a call
    # could address the hypervisor. Type 9999 is invalid for every family, so the kernel itself answers EINVAL
    # before it looks the family up: EAFNOSUPPORT for it can only be the filter's.
    families = [int(f) for f in (socket.AF_VSOCK, socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK, socket.AF_PACKET)]
    code = ("import ctypes, errno, os, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"for family in {families!r}:\n    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, 9999):\n"
            "        try:\n            socket.socket(family, kind)\n            print(family, kind, 'OPENED')\n"
            "        except OSError as err:\n            print(family, kind, errno.errorcode[err.errno])\n"
            "libc.syscall.restype = ctypes.c_long\n"
            "print('io_uring', libc.syscall(425, 8, ctypes.create_string_buffer(120)), "
            "errno.errorcode[ctypes.get_errno()])\n"  # its IORING_OP_SOCKET would pass by the filter
            "a, b = socket.socketpair()\na.send(b'unix works')\nprint(b.recv(100).decode())\n")
    with pytest.raises(OSError) as host:
        socket.socket(socket.AF_VSOCK, 9999)
    assert host.value.errno == errno.EINVAL
    lines = contained(code).output.splitlines()
    assert lines[:-2] == [f"{family} {kind} EAFNOSUPPORT" for family in families for kind in (1, 2, 9999)], lines
    assert lines[-2:] == ["io_uring -1 ENOSYS", "unix works"]


def test_tcp_and_udp_buffers_cannot_hold_memory_outside_the_calls_limit():
    # Unread loopback TCP data was not charged to the call's memory cgroup (v1): a call held about 1.5 GiB
    # against its 1 GiB, and enough of it fills the host-wide TCP pool of every socket.
    code = ("import errno, socket\nheld, keep = 0, []\ntry:\n"
            "    server = socket.create_server(('127.0.0.1', 0))\n    for _ in range(4):\n"
            "        client = socket.create_connection(server.getsockname())\n"
            "        keep += [client, server.accept()[0]]\n        client.setblocking(False)\n        try:\n"
            "            while True:\n                held += client.send(b'x' * 65536)\n"
            "        except BlockingIOError:\n            pass\n"
            "    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n    udp.bind(('127.0.0.1', 0))\n"
            "    held += udp.sendto(b'x' * 60000, udp.getsockname())\n"
            "except OSError as err:\n    print(errno.errorcode[err.errno])\nprint('held', held)\n")
    assert contained(code).output.split() == ["EAFNOSUPPORT", "held", "0"]


def test_a_call_takes_no_inotify_or_queue_quota_of_the_trainers_user():
    # Inotify instances and POSIX queue bytes are counted per user up the user namespaces to the host uid that
    # owns the call's namespace, root's for a root trainer: a call holding 100 instances left root 28, and root's
    # own mq_open failed.
    tag = uuid.uuid4().hex
    code = ("import ctypes, errno, os, signal, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "rt = ctypes.CDLL('librt.so.1', use_errno=True)\nr, w = os.pipe()\n"
            "for _ in range(3):  # 64 descriptors a process: 3 of them can hold the 128 instances a user may\n"
            "    if os.fork() == 0:\n        n = 0\n        while libc.inotify_init1(0) >= 0:\n            n += 1\n"
            "        os.write(w, f'{n} {errno.errorcode[ctypes.get_errno()]}\\n'.encode())\n"
            "        signal.pause()\n"
            "got = b''\nwhile got.count(b'\\n') < 3:\n    got += os.read(r, 100)\nqueues = 0\n"
            "while rt.mq_open(f'/q{queues}'.encode(), os.O_CREAT | os.O_RDWR, 0o600, None) >= 0:\n"
            "    queues += 1\n"
            "print('inotify', got.decode().split(), 'queues', queues, errno.errorcode[ctypes.get_errno()],\n"
            "      flush=True)\n"
            f"os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', '{tag}'])\n")
    done = {}
    call = threading.Thread(target=lambda: done.update(result=contained(code, timeout_s=30.0)))
    call.start()
    holder = None
    try:
        holder = _wait_for_process(tag, call)
        assert holder is not None, done
        libc = ctypes.CDLL(None, use_errno=True)
        rt = ctypes.CDLL("librt.so.1", use_errno=True)
        instance = libc.inotify_init1(os.O_CLOEXEC)
        queue_name = f"/megarl-test-{tag}".encode()
        queue = rt.mq_open(queue_name, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600, None)
        errors = ctypes.get_errno()
        for fd, close in ((instance, os.close), (queue, rt.mq_close)):
            if fd >= 0:
                close(fd)
        rt.mq_unlink(queue_name)
    finally:
        if holder is not None:
            os.kill(holder, signal.SIGKILL)
        call.join()
    assert instance >= 0 and queue >= 0, f"the host's own inotify_init1 or mq_open failed: errno {errors}"
    # nothing to hold in the first place: a tool needs neither
    assert done["result"].output.split("\n")[0] == ("inotify ['0', 'ENOSYS', '0', 'ENOSYS', '0', 'ENOSYS'] "
                                                   "queues 0 ENOSYS"), done["result"].observation


def _wait_for_process(tag, call):
    """The pid of the process whose command line holds `tag`, once it exists; None if the call ends first."""
    while call.is_alive():
        for p in Path("/proc").iterdir():
            if p.name.isdigit() and tag.encode() in _read(p / "cmdline"):
                return int(p.name)
        time.sleep(0.01)
    return None


@pytest.mark.parametrize("code, end", [
    ("import os; os._exit(86)", "exit code 86"),  # was "killed: memory limit"
    ("import os; os._exit(152)", "exit code 152"),  # was "killed: CPU time limit" (128 + SIGXCPU)
    ("import os; os._exit(137)", "exit code 137"),
    ("raise MemoryError", "exit code 1"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGXCPU)", "killed by signal SIGXCPU"),  # 0 s of CPU used
    # 1.2 s of the 2 s limit, then its own SIGKILL (the kernel's comes at the hard limit, 3 s)
    ("import os\nwhile sum(os.times()[:2]) < 1.2:\n    pass\nos.kill(os.getpid(), 9)", "killed by signal SIGKILL"),
])
def test_the_reported_end_cannot_be_forged_by_the_code(code, end):
    assert contained(code).end == end


def test_the_code_cannot_end_the_calls_init_with_a_signal_it_handles():
    # Python handles SIGINT: the init, PID 1, took the code's os.kill(1, SIGINT) as a KeyboardInterrupt and died
    # before reporting, so the host said "sandbox failed"; the code's own Ctrl-C still works
    code = ("import os, signal, time\nos.kill(1, signal.SIGINT)\ntime.sleep(0.5)\nprint('init alive')\n"
            "try:\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(1)\nexcept KeyboardInterrupt:\n"
            "    print('own interrupt')\n")
    result = contained(code)
    assert result.end == "ok" and result.output.split() == ["init", "alive", "own", "interrupt"]


LIMITS = ("import os, re\ntry:\n    os.close(os.open('/proc/1/mem', os.O_RDWR))\n    print('OPENED')\n"
          "except OSError as err:\n    print(err.strerror)\n"
          "for pid in sorted(int(p) for p in os.listdir('/proc') if p.isdigit()):\n"
          "    rows = [re.split(r'\\s{2,}', row) for row in open(f'/proc/{pid}/limits').read().splitlines()]\n"
          "    print(pid, [row[1:3] for row in rows if row[0] in ('Max cpu time', 'Max address space', "
          "'Max processes')])\n")


def _limits_seen(output, config):
    lines = output.splitlines()
    expected = str([[str(config.cpu_s), str(config.cpu_s + 1)], [str(config.max_processes)] * 2,
                    [str(config.memory_bytes)] * 2])
    return lines[0], [line.split(" ", 1) for line in lines[1:]], expected


def test_every_process_of_the_call_pid_1_included_is_under_the_limits():
    # bwrap's PID 1 ran outside the rlimits as the code's own uid; the code could write its /proc/1/mem and hold
    # 45 processes against 32 and 1.5 GiB in one process against 1 GiB
    mem, seen, expected = _limits_seen(contained(LIMITS).output, config())
    assert mem == "Permission denied" and [pid for pid, _ in seen][:1] == ["1"] and len(seen) == 2
    assert all(limits == expected for _, limits in seen), seen


@pytest.mark.skipif(os.geteuid() != 0, reason="the trainer is not root here: the test above is this one")
def test_every_process_is_under_the_limits_for_a_trainer_not_root():
    python, root = "/usr/bin/python3", str(Path(cgroups.__file__).parents[2])
    if subprocess.run([python, "-c", f"import sys; sys.path.insert(0, {root!r}); import megarl.tools.sandbox"],
                      user=61234, group=61234, extra_groups=[], cwd="/", capture_output=True).returncode != 0:
        pytest.skip(f"uid 61234 cannot import megarl.tools.sandbox from {root} with {python} (PyYAML needed)")
    script = ("import json, sys\nfrom megarl.tools.sandbox import SandboxConfig, run_python\n"
              "r = run_python(sys.argv[1], SandboxConfig(python=sys.argv[2], timeout_s=5.0, cpu_s=2, "
              "memory_bytes=256 << 20))\nprint(json.dumps([r.output, r.end, r.layers, r.survivors]))\n")
    done = subprocess.run([python, "-I", "-c", f"import sys; sys.path.insert(0, {root!r})\n" + script, LIMITS,
                           python], user=61234, group=61234, extra_groups=[], cwd="/", capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    output, end, layers, survivors = json.loads(done.stdout)
    assert end == "ok" and survivors == [] and layers["limits"].startswith("none per call"), (end, layers)
    mem, seen, expected = _limits_seen(output, config())
    assert mem == "Permission denied" and [pid for pid, _ in seen][:1] == ["1"] and len(seen) == 2
    assert all(limits == expected for _, limits in seen), seen


NS_GET_OWNER_UID = 0xB704


@pytest.mark.skipif(os.geteuid() != 0, reason="host_uid is for a root trainer")
def test_with_a_host_uid_of_its_own_the_call_counts_against_that_uid_not_roots():
    uid, python = 61235, "/usr/bin/python3"
    init = Path(cgroups.__file__).with_name("sandbox_init.py")
    if subprocess.run(["test", "-r", str(init), "-a", "-x", python], user=uid, group=uid, extra_groups=[]).returncode:
        pytest.skip(f"uid {uid} cannot read {init} or run {python} here; host_uid needs both")
    tag = uuid.uuid4().hex
    code = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', '{tag}'])\n"
    done = {}
    call = threading.Thread(target=lambda: done.update(result=contained(code, python=python, host_uid=uid)))
    call.start()
    holder = None
    try:
        holder = _wait_for_process(tag, call)
        assert holder is not None, done
        # whose per-user counts the call's processes charge: the owner of their user namespaces, up to the host's
        with open(f"/proc/{holder}/ns/user") as ns:
            owner = struct.unpack("I", fcntl.ioctl(ns.fileno(), NS_GET_OWNER_UID, bytes(4)))[0]
        uids = Path(f"/proc/{holder}/status").read_text().split("Uid:")[1].split()[:4]
    finally:
        if holder is not None:
            os.kill(holder, signal.SIGKILL)
        call.join()
    assert owner == uid and uids == [str(uid)] * 4
    limits = contained(LIMITS, python=python, host_uid=uid)  # PID 1 is as safe as under root's namespaces
    mem, seen, expected = _limits_seen(limits.output, config())
    assert mem == "Permission denied" and len(seen) == 2 and all(limits == expected for _, limits in seen), seen


TRAINER = """
import sys
from megarl.tools.sandbox import SandboxConfig, run_python
run_python(sys.argv[1], SandboxConfig(timeout_s=120.0, cpu_s=60))
"""


def _parent(pid):
    fields = _read(Path(f"/proc/{pid}/stat")).rpartition(b")")[2].split()
    return int(fields[1]) if fields else 0


def test_a_call_dies_with_a_trainer_killed_mid_call_and_the_next_trainer_removes_its_cgroup():
    """The trainer SIGKILLed (or ended by SIGTERM, which leaves a running call to the process's exit) while the code
    sleeps: the call's processes die with it. Under a root trainer they lived on under the host's init: the call's
    init dropped root, which cleared the parent-death signal bwrap had armed. The call's cgroup, which only the
    ended call's own clean-up removed, is removed by the next trainer's first call."""
    tag = f"{time.time() % 1000 + 1000:.6f}"  # a sleep duration no other process uses
    code = f"import subprocess, time\nsubprocess.Popen(['sleep', '{tag}'])\ntime.sleep(600)\n"
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    trainer = subprocess.Popen([os.sys.executable, "-c", TRAINER, code], env=env)
    try:
        deadline, sleeper = time.monotonic() + 60, None
        while sleeper is None and time.monotonic() < deadline and trainer.poll() is None:
            sleeper = next((int(p.name) for p in Path("/proc").iterdir()  # not the trainer, whose argv has the tag
                            if p.name.isdigit() and _read(p / "cmdline") == b"sleep\0" + tag.encode() + b"\0"), None)
            time.sleep(0.05)
        assert sleeper is not None, "the call never started"
        script = _parent(sleeper)
        call = [sleeper, script, _parent(script)]  # the sleep, the script's process, the call's init
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + 10
        while (alive := [p for p in call if Path(f"/proc/{p}").exists() and b"Z" not in _read(
                Path(f"/proc/{p}/stat")).rpartition(b")")[2][:3]]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive == [], "processes of the call outlived its trainer"
    finally:
        trainer.kill()
    if CGROUPED:
        subprocess.run([os.sys.executable, "-c", TRAINER, "pass"], env=env, check=True, timeout=120)
        own = cgroups._own_paths()
        left = [d for point, kind, options in cgroups._mounts() for key in ([""] if kind == "cgroup2" else options)
                if key in own for d in Path(point, own[key]).glob(f"megarl-sandbox-{trainer.pid}-*")]
        assert left == []
