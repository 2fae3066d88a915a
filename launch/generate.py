"""Generate from any HF checkpoint or GGUF file through the rollout engine.

    python launch/generate.py --checkpoint=DIR --prompt="Hello" --prompt="2+2=" --max_new_tokens=32
    python launch/generate.py --checkpoint=MODEL.gguf --chat --prompt="What is 2+3?" --temperature=0
    python launch/generate.py --checkpoint=DIR --prompt_ids_json=ids.json --temperature=0 \\
        --json_out=out.json

`--checkpoint` is an HF directory (config.json + safetensors) or a `.gguf` file (Llama family,
`model/gguf_io.py`: its tokenizer, chat template and stop tokens come from the file). Prompts are text
(tokenized with the checkpoint's tokenizer: an HF directory's tokenizer.json with its
tokenizer_config.json, or --tokenizer; the built-in byte tokenizer when neither exists) or token ids
(`--prompt_ids_json`: a JSON list of token-id lists). `--chat` wraps text prompts as a user turn of the
checkpoint's own chat template (`model/chat_template.py`), or of the built-in ChatML when it ships none.
Generation stops at the checkpoint's stop tokens (eos, and e.g. `<|eot_id|>`). With `--json_out`, writes a JSON list with one
object per prompt: token_ids (the generated ids), text, logprobs (under the sampling distribution),
model_logprobs (untempered), finish_reason. A bad prompt is reported in its object's "error" and
the others are still generated.
"""

import json
import os
import sys
import time

from absl import app, flags, logging

from tiderl_jax import console  # noqa: E402
from tiderl_jax import distributed  # noqa: E402
from tiderl_jax.engine.engine import Engine, EngineConfig, Request
from tiderl_jax.engine.sampling import RequestError, SamplingParams
from tiderl_jax.model import chat
from tiderl_jax.model.chat_template import ChatTemplate
from tiderl_jax.model.config import ConfigError
from tiderl_jax.model.gguf_io import load_gguf
from tiderl_jax.model.hf_io import load_hf_checkpoint
from tiderl_jax.model.tokenizer import Tokenizer

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "HF checkpoint directory (config.json + safetensors) or a .gguf file.")
flags.DEFINE_multi_string("prompt", [], "A text prompt (repeatable).")
flags.DEFINE_string("prompt_ids_json", None, "JSON file: a list of token-id lists.")
flags.DEFINE_string("tokenizer", None, "tokenizer.json or a directory holding it (default: the checkpoint's, "
                    "else built-in bytes).")
flags.DEFINE_bool("chat", False, "Wrap text prompts as a user turn of the chat template.")
flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate per prompt.")
flags.DEFINE_float("temperature", 1.0, "Sampling temperature; 0 means greedy.")
flags.DEFINE_integer("top_k", 0, "Top-k (0: off).")
flags.DEFINE_float("top_p", 1.0, "Top-p (1: off).")
flags.DEFINE_integer("seed", 0, "Seed of prompt i is seed + i.")
flags.DEFINE_bool("stop_at_eos", True, "Stop at the checkpoint's stop tokens (eos, end of turn).")
flags.DEFINE_string("dtype", "float32", "Compute dtype: float32 or bfloat16.")
flags.DEFINE_integer("max_seq_len", 4096, "Longest context the engine holds.")
flags.DEFINE_integer("num_pages", 4096, "KV pages in the pool.")
flags.DEFINE_string("json_out", None, "Write results here as JSON.")
distributed.define_flags()


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _tokenizer(path):
    """--tokenizer (a directory, or a tokenizer.json with its tokenizer_config.json beside it when there is
    one), else the checkpoint directory's, else the built-in byte tokenizer."""
    if path and not os.path.isdir(path):
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.basename(path) == "tokenizer.json" and os.path.exists(os.path.join(folder, "tokenizer_config.json")):
            return Tokenizer.from_checkpoint(folder)
        return Tokenizer.from_file(path)
    if path is None and os.path.exists(os.path.join(FLAGS.checkpoint, "tokenizer.json")):
        path = FLAGS.checkpoint
    return Tokenizer.from_checkpoint(path) if path else Tokenizer.builtin()


def _load():
    """(model, tokenizer) of --checkpoint: a .gguf file brings its own tokenizer (unless --tokenizer)."""
    if FLAGS.checkpoint.endswith(".gguf") or os.path.isfile(FLAGS.checkpoint):
        model, tokenizer = load_gguf(FLAGS.checkpoint, dtype=FLAGS.dtype)
        return model, (_tokenizer(FLAGS.tokenizer) if FLAGS.tokenizer else tokenizer)
    return load_hf_checkpoint(FLAGS.checkpoint, dtype=FLAGS.dtype), _tokenizer(FLAGS.tokenizer)


def _prompts(tokenizer):
    prompts = []
    if FLAGS.prompt_ids_json:
        try:
            with open(FLAGS.prompt_ids_json) as f:
                ids = json.load(f)
        except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
            _fail(f"--prompt_ids_json={FLAGS.prompt_ids_json}: {e}")
        if not isinstance(ids, list) or not all(isinstance(p, list) for p in ids):
            _fail(f"--prompt_ids_json={FLAGS.prompt_ids_json}: must be a JSON list of token-id lists")
        prompts += ids
    template = ChatTemplate.for_tokenizer(tokenizer) if FLAGS.chat else None
    for text in FLAGS.prompt:
        message = [chat.Message("user", text)]
        if template is not None:
            prompts.append(template.encode(message, add_generation_prompt=True).ids)
        elif FLAGS.chat:
            prompts.append(chat.encode(tokenizer, message, add_generation_prompt=True).ids)
        else:
            bos = [tokenizer.bos_id] if tokenizer.add_bos else []
            prompts.append(bos + tokenizer.encode(text))
    if not prompts:
        _fail("no prompts: give --prompt and/or --prompt_ids_json")
    return prompts


def main(argv):
    del argv
    console.setup()
    if not FLAGS.checkpoint:
        _fail("--checkpoint is required")
    try:
        model, tokenizer = _load()
        prompts = _prompts(tokenizer)
    except ConfigError as e:
        _fail(str(e))
    page = 16
    engine = Engine(model, EngineConfig(num_pages=FLAGS.num_pages, max_seq_len=-(-FLAGS.max_seq_len // page) * page,
                                        page_size=page))
    stop = tuple(i for i in tokenizer.stop_ids if i < model.cfg.vocab_size) if FLAGS.stop_at_eos else ()
    results = [None] * len(prompts)
    handles = {}
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
                            seed=FLAGS.seed + i, max_new_tokens=FLAGS.max_new_tokens, stop_ids=stop)
        try:
            handles[i] = engine.submit(Request(p, sp))
        except RequestError as e:
            results[i] = {"prompt_index": i, "error": str(e)}
            logging.error("prompt %d refused: %s", i, e)
    t0 = time.perf_counter()
    engine.run()
    seconds = time.perf_counter() - t0
    for i, h in handles.items():
        o = engine.get(h)
        n = len(o.new_tokens)
        results[i] = {"prompt_index": i, "token_ids": o.new_tokens,
                      "text": tokenizer.decode([t for t in o.new_tokens if t < tokenizer.vocab_size]),
                      "logprobs": o.logp_sample[-n:] if n else [],
                      "model_logprobs": o.logp_model[-n:] if n else [],
                      "finish_reason": o.finish_reason}
    generated = sum(len(r.get("token_ids", [])) for r in results)
    for r in results:
        if "error" in r:
            print(f"[{r['prompt_index']}] error: {r['error']}")
        else:
            print(f"[{r['prompt_index']}] ({len(r['token_ids'])} tokens, {r['finish_reason']}) {r['text']!r}")
    stats = engine.stats()
    print(f"generated {generated} tokens for {len(handles)} prompts in {seconds:.2f}s "
          f"({generated / max(seconds, 1e-9):.0f} tokens/s, including {stats['compile_s']:.1f}s of compiles)")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(distributed.single_process_main(main, "launch/generate.py"))
