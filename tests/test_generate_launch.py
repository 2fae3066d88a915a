"""launch/generate.py: HF checkpoint -> engine -> printed results and a JSON file."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np

from conftest import FIXTURES, ROOT


def _run(*args):
    return subprocess.run([sys.executable, "launch/generate.py", *args], cwd=ROOT, env=dict(os.environ),
                          capture_output=True, text=True, timeout=300)


def test_greedy_ids_match_transformers_and_bad_prompts_are_reported(tmp_path):
    ref = np.load(FIXTURES / "llama" / "logits.npz")
    prompts = [ref["greedy_prompt_0"].tolist(), ref["greedy_prompt_1"].tolist(), [], [1, 9999]]
    (tmp_path / "ids.json").write_text(json.dumps(prompts))
    n = ref["greedy_tokens"].shape[1]
    r = _run(f"--checkpoint={FIXTURES / 'llama'}", f"--prompt_ids_json={tmp_path / 'ids.json'}",
             "--temperature=0", f"--max_new_tokens={n}", "--stop_at_eos=false",
             f"--json_out={tmp_path / 'out.json'}", "--max_seq_len=128", "--num_pages=64")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert [o["token_ids"] for o in out[:2]] == ref["greedy_tokens"].tolist()
    assert all(len(o["logprobs"]) == n and len(o["model_logprobs"]) == n for o in out[:2])
    assert "prompt is empty" in out[2]["error"] and "outside [0, 256)" in out[3]["error"]
    assert "tokens/s" in r.stdout


def test_text_prompts_and_sampling(tmp_path):
    r = _run(f"--checkpoint={FIXTURES / 'qwen3'}", "--prompt=hi", "--prompt=2+2=",
             "--temperature=0.8", "--top_p=0.9", "--max_new_tokens=5", f"--json_out={tmp_path / 'o.json'}",
             "--max_seq_len=128", "--num_pages=64", "--stop_at_eos=false")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads((tmp_path / "o.json").read_text())
    assert [len(o["token_ids"]) for o in out] == [5, 5] and all(isinstance(o["text"], str) for o in out)


def test_missing_checkpoint_is_a_named_error():
    r = _run("--checkpoint=/nonexistent", "--prompt=x")
    assert r.returncode == 2 and "no config.json" in r.stderr


def test_llama3_style_tokenizer_loads_and_its_stop_tokens_apply(tmp_path):
    """A checkpoint whose tokenizer has no <|im_end|> (Llama 3's eos / eot / eom, in tokenizer_config.json and
    generation_config.json) loads; generation stops at its stop tokens (here all outside the tiny model's
    vocabulary, so it runs to max_new_tokens)."""
    from test_chat_template import _llama_tok
    path = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "llama", path)
    tok = _llama_tok()
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(tok.stop_ids)}))
    r = _run(f"--checkpoint={path}", "--prompt=hi", "--temperature=0", "--max_new_tokens=3",
             f"--json_out={tmp_path / 'o.json'}", "--max_seq_len=64", "--num_pages=16")
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(json.loads((tmp_path / "o.json").read_text())[0]["token_ids"]) == 3
