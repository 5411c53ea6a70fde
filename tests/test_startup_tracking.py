"""A run that ends before its first step still has its mlflow run, with its params: FAILED after a start-up error,
KILLED after an interrupt (docs/troubleshooting.md), where it used to have none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from helpers import REPO, only_mlflow_run


def test_a_start_up_error_leaves_a_failed_mlflow_run_with_the_configs_params(tmp_path):
    gone = tmp_path / "gone"
    proc = subprocess.run([sys.executable, "megarl/train.py", "--config", "recipes/tiny_cpu_grpo.yaml",
                           "--set", f"model.hf_path={gone}", "--set", f"checkpoint.dir={tmp_path / 'run'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=os.environ | {"PYTHONPATH": str(REPO), "MEGARL_DEBUG": "0"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [f"megarl error: model.hf_path = '{gone}': model directory `{gone}` "
                                                "does not exist. Pass a HuggingFace model directory holding "
                                                "config.json and *.safetensors."]
    run = only_mlflow_run(f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")[1]
    assert run.info.status == "FAILED"
    assert run.data.params["model.hf_path"] == str(gone) and run.data.params["trainer.num_steps"] == "200"


def test_an_interrupt_before_the_first_step_leaves_a_killed_mlflow_run(tmp_path):
    """Ctrl-C once the config is read, while the run starts (run_main and its clean-ups as train.py's)."""
    store = f"sqlite:///{tmp_path / 'store.db'}"
    script = textwrap.dedent(f"""
        import os, signal, time
        from megarl.config import load_config, run_dir
        from megarl.run import interrupt
        from megarl.run.command import run_main
        from megarl.run.tracking import record_if_it_ends

        def main():
            interrupt.install()
            cfg = load_config("recipes/tiny_cpu_grpo.yaml", ["tracking.uri={store}",
                                                             "checkpoint.dir={tmp_path / 'run'}"])
            record_if_it_ends(cfg, run_dir(cfg))
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)

        run_main(main)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(REPO), "MEGARL_DEBUG": "0"})
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-3000:]
    run = only_mlflow_run(store)[1]
    assert run.info.status == "KILLED" and run.data.params["rollout.engine"] == "vllm"
