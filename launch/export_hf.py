"""Convert a GGUF checkpoint (Llama family) to the Hugging Face format that transformers reads.

    python launch/export_hf.py --checkpoint=SmolLM2-135M-Instruct.Q4_1.gguf --out=/tmp/smollm2_hf

Writes config.json, model.safetensors (the dequantized weights, float32 unless --dtype=bfloat16),
tokenizer.json, tokenizer_config.json (special tokens and the chat template) and
generation_config.json (the stop ids). The result loads with `AutoModelForCausalLM` /
`AutoTokenizer`, `load_hf_checkpoint` and `launch/generate.py --checkpoint=OUT`. Bad input exits 2
with a one-line error.
"""

import sys

from absl import app, flags

from tiderl_jax import console  # noqa: E402
from tiderl_jax import distributed  # noqa: E402
from tiderl_jax.model.config import ConfigError
from tiderl_jax.model.gguf_io import load_gguf
from tiderl_jax.model.hf_io import export_hf

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "The .gguf file.")
flags.DEFINE_string("out", None, "Output directory (created).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Dtype of the written weights.")
distributed.define_flags()


def main(argv):
    del argv
    console.setup()
    if not FLAGS.checkpoint or not FLAGS.out:
        print("error: --checkpoint and --out are required", file=sys.stderr)
        sys.exit(2)
    try:
        model, tokenizer = load_gguf(FLAGS.checkpoint)
        export_hf(model, tokenizer, FLAGS.out, dtype=FLAGS.dtype)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {FLAGS.out}: {model.cfg.num_params / 1e6:.1f}M parameters, vocabulary {tokenizer.vocab_size}")


if __name__ == "__main__":
    app.run(distributed.single_process_main(main, "launch/export_hf.py"))
