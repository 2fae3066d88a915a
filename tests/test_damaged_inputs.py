"""Damaged input files (issue 42): a truncated or corrupt safetensors, GGUF, tokenizer, orbax checkpoint,
run_state.json or dataset file is a named error from its reader (the file and what is wrong), and each
`launch/` script that reads it ends with status 2 and one `error:` line, no traceback.

The damage is done to real files (the shipped checkpoints/tiny_agentic_sft, the tiny Llama fixture written as
a GGUF): cut to half, bytes overwritten in the middle (of the part a reader can check: a header or metadata;
weights carry no checksum), or garbage in place of JSON."""

import gzip
import json
import os
import shutil
import struct
import subprocess
import sys

import jax.numpy as jnp
import pytest

from conftest import ROOT
from tiderl_jax.data import datasets
from tiderl_jax.data.datasets import DatasetError
from tiderl_jax.model import gguf_io
from tiderl_jax.model.config import ConfigError
from tiderl_jax.model.hf_io import CheckpointError, load_hf_checkpoint
from tiderl_jax.model.tokenizer import Tokenizer
from tiderl_jax.run_state import RunState

SFT = ROOT / "checkpoints" / "tiny_agentic_sft"
GARBAGE = b"\x93\xffNUMPY garbage, not JSON \xfe\x00{["


# ---------------------------------------------------------------------------------------- damage


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def corrupt(path, at=None, n=8):
    """`n` bytes 0xFF (never valid UTF-8) at offset `at` (default: the middle)."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at:at + n] = b"\xff" * n
    path.write_bytes(bytes(data))


def safetensors_header_middle(path) -> int:
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8 + n // 2


def gguf_tokens_at(path) -> int:
    """The offset of the first vocabulary string of a GGUF file (after the key, the array's value type, item type
    and count, and the string's length)."""
    key = b"tokenizer.ggml.tokens"
    return path.read_bytes().index(key) + len(key) + 4 + 4 + 8 + 8


def hf_copy(tmp_path, name="ckpt", tokenizer_config=False):
    """A copy of the shipped checkpoint (with a tokenizer_config.json written beside its tokenizer.json)."""
    path = tmp_path / name
    shutil.copytree(SFT, path)
    if tokenizer_config:
        Tokenizer.from_checkpoint(path).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    from test_gguf_io import _llama_fixture, write_gguf
    hf_cfg, tensors, factors = _llama_fixture()
    path = tmp_path_factory.mktemp("gguf") / "llama.gguf"
    write_gguf(path, hf_cfg, tensors, rope_factors=factors)
    return path


def gguf_copy(gguf_file, tmp_path):
    path = tmp_path / "damaged.gguf"
    shutil.copy(gguf_file, path)
    return path


# ---------------------------------------------------------------------------------------- the readers


def test_safetensors_truncated_corrupt_or_garbage_is_named(tmp_path):
    path = hf_copy(tmp_path, "cut")
    truncate(path / "model.safetensors")
    size = (SFT / "model.safetensors").stat().st_size
    with pytest.raises(CheckpointError, match=rf"model.safetensors: truncated \(header says {size:,} bytes, "
                                              rf"file has {size // 2:,}\)"):
        load_hf_checkpoint(path)
    path = hf_copy(tmp_path, "header")
    corrupt(path / "model.safetensors", safetensors_header_middle(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt safetensors header"):
        load_hf_checkpoint(path)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(CheckpointError, match=r"corrupt safetensors header \(a JSON list"):
        load_hf_checkpoint(path)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": "x"}}).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError, match="corrupt safetensors header .tensor w:"):
        load_hf_checkpoint(path)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CheckpointError, match="truncated or corrupt .its header length says"):
        load_hf_checkpoint(path)
    (path / "config.json").write_bytes(GARBAGE)
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        load_hf_checkpoint(path)
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON \(a list, not an object\)"):
        load_hf_checkpoint(path)
    (path / "config.json").write_text(json.dumps(dict(json.loads((SFT / "config.json").read_text()),
                                                      num_hidden_layers="two")))
    with pytest.raises(CheckpointError, match="config.json: a value of the wrong type"):
        load_hf_checkpoint(path)
    path = hf_copy(tmp_path, "index")
    (path / "model.safetensors.index.json").write_bytes(GARBAGE)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: not valid JSON"):
        load_hf_checkpoint(path)


def test_gguf_truncated_or_corrupt_metadata_is_named(gguf_file, tmp_path):
    path = gguf_copy(gguf_file, tmp_path)
    truncate(path)
    with pytest.raises(CheckpointError, match=r"damaged.gguf: truncated or corrupt GGUF file \([\d,]+ bytes; "):
        gguf_io.load_gguf(path)
    path = gguf_copy(gguf_file, tmp_path)
    corrupt(path, gguf_tokens_at(path), n=1)
    with pytest.raises(CheckpointError, match="damaged.gguf: corrupt GGUF metadata 'tokenizer.ggml.tokens' "
                                              r"\(UnicodeDecodeError"):
        gguf_io.load_gguf(path)


def test_tokenizer_files_truncated_corrupt_or_garbage_are_named(tmp_path):
    path = hf_copy(tmp_path, tokenizer_config=True)
    corrupt(path / "tokenizer_config.json")
    with pytest.raises(ConfigError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer.from_checkpoint(path)
    (path / "tokenizer_config.json").write_text('"<|im_end|>"')
    with pytest.raises(ConfigError, match=r"tokenizer_config.json: not valid JSON \(a str, not an object\)"):
        Tokenizer.from_checkpoint(path)
    path = hf_copy(tmp_path, "gen", tokenizer_config=True)
    (path / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(ConfigError, match="generation_config.json: eos_token_id 'x' is not in the vocabulary"):
        Tokenizer.from_checkpoint(path)
    (path / "generation_config.json").write_text('{"eos_token_id": null}')  # as HF writes "none"
    assert Tokenizer.from_checkpoint(path).stop_ids == Tokenizer.from_checkpoint(SFT).stop_ids
    truncate(path / "tokenizer.json")
    with pytest.raises(ConfigError, match="tokenizer.json could not be parsed"):
        Tokenizer.from_checkpoint(path)


def _rows(n=7):
    return [json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) for i in range(n)]


def test_dataset_files_truncated_or_corrupt_are_named(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(_rows()) + "\n")
    truncate(path)  # the last line is cut off: a damaged file, not a malformed row
    with pytest.raises(DatasetError, match=r"train.jsonl: truncated \(its last line, row \d, is cut off"):
        datasets.load_dataset(str(path))
    path.write_bytes(b"\n".join(r.encode() for r in _rows()[:2]) + b"\n\xff\xfe garbage\n" + _rows()[2].encode())
    ds = datasets.load_dataset(str(path))  # a row that is not UTF-8 inside an intact file: a malformed row
    assert len(ds) == 3 and [str(e) for e in ds.errors] == [f"{path}, row 3: not UTF-8 text (byte 1)"]
    path.write_bytes(GARBAGE)
    with pytest.raises(DatasetError, match=r"no usable row in .*train.jsonl \(1 malformed\)"):
        datasets.load_dataset(str(path))
    gz = tmp_path / "train.jsonl.gz"
    gz.write_bytes(gzip.compress(("\n".join(_rows(200)) + "\n").encode()))
    truncate(gz)
    with pytest.raises(DatasetError, match=r"train.jsonl.gz: truncated or corrupt after row \d+ \(EOFError"):
        datasets.load_dataset(str(gz))
    gz.write_bytes(gzip.compress(("\n".join(_rows(200)) + "\n").encode()))
    corrupt(gz, n=64)
    with pytest.raises(DatasetError, match=r"train.jsonl.gz: truncated or corrupt after row \d+"):
        datasets.load_dataset(str(gz))


def test_parquet_truncated_or_garbage_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([json.loads(r) for r in _rows(100)]), path)
    truncate(path)
    with pytest.raises(DatasetError, match=r"train.parquet: not a readable parquet file, truncated or corrupt"):
        datasets.load_dataset(str(path))
    path.write_bytes(GARBAGE)
    with pytest.raises(DatasetError, match=r"train.parquet: not a readable parquet file"):
        datasets.load_dataset(str(path))


def test_run_state_garbage_is_named(tmp_path):
    (tmp_path / "run_state.json").write_bytes(GARBAGE)
    with pytest.raises(ConfigError, match="run_state.json: not valid JSON .*; delete the log directory"):
        RunState(str(tmp_path), {})
    (tmp_path / "run_state.json").write_text("[]")
    with pytest.raises(ConfigError, match=r"run_state.json: not valid JSON \(a list, not an object\)"):
        RunState(str(tmp_path), {})


def test_orbax_checkpoint_truncated_or_garbage_meta_is_named(tmp_path):
    from tiderl_jax.rl.checkpoint import Checkpointer
    arrays = {"params": {"w": jnp.arange(64 * 1024, dtype=jnp.float32).reshape(64, 1024)}}
    for damage in ("truncate", "meta"):
        ckpt = Checkpointer(tmp_path / damage, async_save=False)
        ckpt.save(1, arrays, {"step": 1})
        step = tmp_path / damage / "1"
        if damage == "truncate":
            largest = max((p for p in (step / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
            truncate(largest)
        else:
            (step / "meta" / "metadata").write_bytes(GARBAGE)
        with pytest.raises(CheckpointError, match=f"cannot restore step 1 from {tmp_path / damage}: "):
            ckpt.restore(arrays)
        ckpt.close()


# ---------------------------------------------------------------------------------------- the entry points


def _launch(script, *args, timeout=240):
    return subprocess.run([sys.executable, f"launch/{script}", *args], cwd=ROOT, env=dict(os.environ),
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(r, *named):
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and all(n in lines[0] for n in named), r.stderr[-3000:]
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]


def _hf_truncated(tmp_path, gguf_file):
    path = hf_copy(tmp_path)
    truncate(path / "model.safetensors")
    return path, f"{path}/model.safetensors: truncated"


def _hf_header_corrupt(tmp_path, gguf_file):
    path = hf_copy(tmp_path)
    corrupt(path / "model.safetensors", safetensors_header_middle(path / "model.safetensors"))
    return path, f"{path}/model.safetensors: corrupt safetensors header"


def _hf_config_garbage(tmp_path, gguf_file):
    path = hf_copy(tmp_path)
    (path / "config.json").write_bytes(GARBAGE)
    return path, f"{path}/config.json: not valid JSON"


def _gguf_truncated(tmp_path, gguf_file):
    path = gguf_copy(gguf_file, tmp_path)
    truncate(path)
    return path, f"{path}: truncated or corrupt GGUF file"


def _gguf_metadata_corrupt(tmp_path, gguf_file):
    path = gguf_copy(gguf_file, tmp_path)
    corrupt(path, gguf_tokens_at(path), n=1)
    return path, f"{path}: corrupt GGUF metadata 'tokenizer.ggml.tokens'"


def _tokenizer_config_corrupt(tmp_path, gguf_file):
    path = hf_copy(tmp_path, tokenizer_config=True)
    corrupt(path / "tokenizer_config.json")
    return path, f"{path}/tokenizer_config.json: not valid JSON"


def _tokenizer_truncated(tmp_path, gguf_file):
    path = hf_copy(tmp_path)
    truncate(path / "tokenizer.json")
    return path, f"{path}/tokenizer.json could not be parsed"


def _tokenizer_garbage(tmp_path, gguf_file):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(GARBAGE)
    return path, f"{path} could not be parsed"


def _checkpoint_flags(script, path, tmp_path):
    """The flags that make `script` read checkpoint `path`."""
    return {"generate.py": [f"--checkpoint={path}", "--prompt=x", "--max_seq_len=64", "--num_pages=16"],
            "serve.py": [f"--checkpoint={path}", "--port=0"],
            "export_hf.py": [f"--checkpoint={path}", f"--out={tmp_path / 'out'}"],
            "sft.py": ["--config=configs/tiny_agentic.py", f"--init={path}", f"--out={tmp_path / 'out'}"],
            "sample.py": ["--config=configs/tiny.py", f"--config.checkpoint={path}"],
            "train.py": ["--config=configs/tiny_agentic.py", f"--config.logdir={tmp_path / 'run'}",
                         f"--config.checkpoint={path}"]}[script]


def _tokenizer_flags(script, path, tmp_path):
    """The flags that make `script` read tokenizer.json `path` (the config's `tokenizer.path`)."""
    return {"sample.py": ["--config=configs/tiny.py", f"--config.tokenizer.path={path}"],
            "sft.py": ["--config=configs/tiny_agentic.py", f"--config.tokenizer.path={path}",
                       f"--out={tmp_path / 'out'}"]}[script]


@pytest.mark.parametrize("script,damage", [
    ("generate.py", _hf_truncated), ("serve.py", _hf_header_corrupt), ("sample.py", _hf_truncated),
    ("train.py", _hf_config_garbage), ("sft.py", _hf_truncated),
    ("generate.py", _gguf_metadata_corrupt), ("serve.py", _gguf_truncated), ("export_hf.py", _gguf_truncated),
    ("sample.py", _gguf_metadata_corrupt), ("train.py", _gguf_truncated),
    ("generate.py", _tokenizer_config_corrupt), ("serve.py", _tokenizer_truncated),
    ("train.py", _tokenizer_config_corrupt),
], ids=lambda x: x.strip("_") if isinstance(x, str) else x.__name__.strip("_"))
def test_a_damaged_checkpoint_is_one_line_and_exit_2(tmp_path, gguf_file, script, damage):
    path, named = damage(tmp_path, gguf_file)
    assert_one_line_error(_launch(script, *_checkpoint_flags(script, path, tmp_path)), named)


@pytest.mark.parametrize("script,damage", [("sample.py", _tokenizer_garbage), ("sft.py", _tokenizer_truncated)],
                         ids=["sample", "sft"])
def test_a_damaged_tokenizer_file_is_one_line_and_exit_2(tmp_path, gguf_file, script, damage):
    path, named = damage(tmp_path, gguf_file)
    file = path / "tokenizer.json" if path.is_dir() else path
    assert_one_line_error(_launch(script, *_tokenizer_flags(script, file, tmp_path)), named)


def _train_data(tmp_path, name, damage):
    path = tmp_path / name
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist([json.loads(r) for r in _rows(100)]), path)
    else:
        path.write_text("\n".join(_rows()) + "\n")
    damage(path)
    return _launch("train.py", "--config=configs/tiny_agentic.py", f"--config.logdir={tmp_path / 'run'}",
                   f"--config.data.train_files={path}")


@pytest.mark.parametrize("name,damage,named", [
    ("train.jsonl", truncate, "train.jsonl: truncated (its last line, row"),
    ("train.jsonl", lambda p: p.write_bytes(GARBAGE), "no usable row in {path}"),
    ("train.parquet", truncate, "train.parquet: not a readable parquet file, truncated or corrupt"),
], ids=["jsonl-truncated", "jsonl-garbage", "parquet-truncated"])
def test_a_damaged_dataset_is_one_line_and_exit_2(tmp_path, name, damage, named):
    assert_one_line_error(_train_data(tmp_path, name, damage), named.format(path=tmp_path / name), str(tmp_path / name))


def test_a_damaged_run_state_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run_state.json").write_bytes(GARBAGE)
    r = _launch("train.py", "--config=configs/tiny_agentic.py", f"--config.logdir={tmp_path / 'run'}")
    assert_one_line_error(r, f"{tmp_path / 'run' / 'run_state.json'}: not valid JSON")


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_damaged_rl_checkpoint_is_one_line_and_exit_2(tmp_path):
    """A finished one-step run, its latest orbax checkpoint cut: continuing it (a raised step budget) restores
    from that checkpoint and stops with the directory named."""
    from test_main_job import TINY
    args = ["--config=configs/tiny_agentic.py", f"--config.logdir={tmp_path}", *TINY, "--config.eval.every=0"]
    r = _launch("train.py", *args, "--config.controller.steps=1", timeout=480)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    params = tmp_path / "checkpoints" / "1" / "params"
    truncate(max((p for p in params.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size))
    r = _launch("train.py", *args, "--config.controller.steps=2")
    assert_one_line_error(r, f"cannot restore step 1 from {tmp_path / 'checkpoints'}: ")


def test_a_damaged_prompt_ids_file_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "ids.json").write_bytes(GARBAGE)
    r = _launch("generate.py", f"--checkpoint={SFT}", f"--prompt_ids_json={tmp_path / 'ids.json'}")
    assert_one_line_error(r, f"--prompt_ids_json={tmp_path / 'ids.json'}: ")
