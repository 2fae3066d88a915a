"""The main job runs end to end from the command line, and bad configs end it with a named error."""

import os
import subprocess
import sys

from conftest import FIXTURES, ROOT


def _run(*args, timeout=300):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "launch/sample.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_main_job_samples_on_the_cpu_default():
    r = _run("--config=configs/tiny.py", "--config.model.num_layers=2", "--config.sample.batch_size=4",
             "--config.sample.max_new_tokens=8")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done: qwen3" in r.stdout and "tokens/s" in r.stdout
    assert "mesh {'data': 1, 'fsdp': 4, 'tensor': 2, 'context': 1}" in r.stdout


def test_unknown_config_key_is_a_named_error():
    r = _run("--config=configs/tiny.py", "--config.model.num_layerz=2")
    assert r.returncode == 2
    assert "config.model has no key 'num_layerz'" in r.stderr


def test_bad_values_and_checkpoints_are_named_errors():
    r = _run("--config.model.num_kv_heads=3")
    assert r.returncode == 2 and "must be a multiple of num_kv_heads=3" in r.stderr
    # The fixture's 256-id vocabulary cannot hold the built-in tokenizer's 265 ids.
    r = _run(f"--config.checkpoint={FIXTURES / 'qwen2'}")
    assert r.returncode == 2 and "tokenizer has 265 ids but model.vocab_size is 256" in r.stderr
    r = _run("--config.checkpoint=/nonexistent/dir")
    assert r.returncode == 2 and "no config.json" in r.stderr


def _train(*args, timeout=300):
    return subprocess.run([sys.executable, "launch/train.py", "--config=configs/tiny_agentic.py", *args],
                          cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=timeout)


def test_train_job_refuses_bad_settings_by_name(tmp_path):
    r = _train(f"--config.logdir={tmp_path}", "--config.controller.mode=fast")
    assert r.returncode == 2 and "controller.mode='fast' is not one of" in r.stderr
    r = _train(f"--config.logdir={tmp_path}", "--config.loss.clip_low=1.5")
    assert r.returncode == 2 and "clip_low=1.5" in r.stderr
    r = _train(f"--config.logdir={tmp_path}", "--config.trainer.learning_rat=1")
    assert r.returncode == 2 and "config.trainer has no key 'learning_rat'" in r.stderr
