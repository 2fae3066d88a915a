"""Serve a checkpoint over the OpenAI API (docs/serving.md): the rollout engine behind an HTTP server.

    python launch/serve.py --checkpoint=checkpoints/tiny_agentic_sft
    python launch/serve.py --checkpoint=MODEL.gguf --port=8001 --api_key=sk-local
    python launch/serve.py --checkpoint=DIR --config=configs/qwen2_5_0_5b.py --host=0.0.0.0 --api_key=$KEY

Then any OpenAI client talks to `http://HOST:PORT/v1` (`/v1/models`, `/v1/chat/completions`,
`/v1/completions`; `/tokenize`, `/detokenize`, `/health`, `/metrics`). `--checkpoint` is an HF directory
(config.json + safetensors, its tokenizer and chat template) or a `.gguf` file. `--config` (optional) is a
config file whose `model` dtypes, `mesh`, `cpu_devices` and, when it has one, `engine` section apply; without
it the model is served on one device with an engine sized by `--max_seq_len` / `--num_pages`.
`--replicas=N` serves N engine replicas (one device each) behind the rollout service's router.

Stopping: SIGTERM (what Kubernetes, Slurm and preemptible VMs send) or Ctrl-C drains: the listener closes at once
(new connections are refused), requests in flight get up to `--drain_s` seconds to finish, then the server stops
and exits 0; a second signal stops it at once.

Security: the server binds 127.0.0.1 unless `--host` says otherwise, and refuses to start on any other address
without `--api_key` (clients then send `Authorization: Bearer KEY`). Bad flags exit 2 with one line.
"""

import asyncio
import importlib.util
import ipaddress
import os
import sys

from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiderl_jax import console  # noqa: E402
from tiderl_jax import distributed  # noqa: E402
from tiderl_jax import config as config_lib  # noqa: E402
from tiderl_jax import interrupts  # noqa: E402
from tiderl_jax.model.config import ConfigError  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "HF checkpoint directory or a .gguf file.")
flags.DEFINE_string("config", None, "Optional config file (model dtypes, mesh, engine section).")
flags.DEFINE_string("host", "127.0.0.1", "Address to bind; anything but loopback needs --api_key.")
flags.DEFINE_integer("port", 8000, "Port (0: a free one, printed).")
flags.DEFINE_string("api_key", None, "Clients must send Authorization: Bearer API_KEY.")
flags.DEFINE_string("served_model_name", None, "Model id of /v1/models (default: the checkpoint's name).")
flags.DEFINE_integer("max_seq_len", 4096, "Longest context (without a config's engine section).")
flags.DEFINE_integer("num_pages", 4096, "KV pages per replica (without a config's engine section).")
flags.DEFINE_integer("replicas", 1, "Engine replicas, one device each (without --config).")
flags.DEFINE_string("router", "least_loaded", "Router policy of the rollout service (policies/routing.py).")
flags.DEFINE_enum("kv_mode", "ctb", ["ctb", "request"], "ctb: a session's KV stays pinned between its calls.")
flags.DEFINE_integer("max_tokens", 4096, "Largest max_tokens a request may ask for.")
flags.DEFINE_integer("max_inflight", 256, "Requests served at once; more get 429.")
flags.DEFINE_integer("max_body_bytes", 4 << 20, "Largest request body.")
flags.DEFINE_float("session_ttl_s", 600.0, "Idle sessions are ended after this long (their KV released).")
flags.DEFINE_bool("chatml_tools", False, "Built-in ChatML only: list a request's tools in the system message.")
flags.DEFINE_bool("warmup", False, "Compile every engine program before serving.")
flags.DEFINE_float("drain_s", 30.0, "On SIGTERM / Ctrl-C, seconds the requests in flight get to finish.")
distributed.define_flags()


def _fail(message: str, status: int = 2):
    message = " | ".join(line.strip() for line in str(message).strip().splitlines() if line.strip())
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_flags():
    if not FLAGS.checkpoint:
        _fail("--checkpoint is required (an HF directory or a .gguf file)")
    if not os.path.exists(FLAGS.checkpoint):
        _fail(f"--checkpoint={FLAGS.checkpoint}: no such file or directory")
    if not is_loopback(FLAGS.host) and not FLAGS.api_key:
        _fail(f"--host={FLAGS.host} is not a loopback address: refusing to serve without --api_key")
    if not 0 <= FLAGS.port < 65536:
        _fail(f"--port={FLAGS.port} is not a port")
    if FLAGS.replicas < 1:
        _fail(f"--replicas={FLAGS.replicas} must be >= 1")
    if FLAGS.drain_s < 0:
        _fail(f"--drain_s={FLAGS.drain_s} must be >= 0")


def _build():
    """(engines, tokenizer, model name) from the flags; ConfigError / ValueError on bad input."""
    import jax
    from flax import nnx

    from tiderl_jax.engine.engine import Engine, EngineConfig
    from tiderl_jax.model.sharding import make_mesh
    from tiderl_jax.runtime.devices import model_on

    cfg = config_lib.load_config_file(FLAGS.config) if FLAGS.config else config_lib.base_config()
    with cfg.unlocked():
        cfg.checkpoint = FLAGS.checkpoint
    config_lib.apply_platform_settings(cfg)
    arch = config_lib.checkpoint_config(cfg.checkpoint)
    if "engine" in cfg:
        engine_cfg = config_lib.rl_configs(cfg)[2]
    else:  # no longer than the model's positions
        page, longest = 16, min(FLAGS.max_seq_len, arch.max_position_embeddings)
        engine_cfg = EngineConfig(page_size=page, num_pages=FLAGS.num_pages, max_seq_len=longest // page * page)
    if FLAGS.config:  # the config's mesh, one replica
        _, _, tokenizer, model = config_lib.build(cfg)
        engines = [Engine(model, engine_cfg)]
    else:  # one device per replica
        devices = jax.devices()
        if FLAGS.replicas > len(devices):
            raise ConfigError(f"--replicas={FLAGS.replicas}: only {len(devices)} devices")
        tokenizer = config_lib.build_tokenizer(cfg)
        if config_lib.is_gguf(cfg.checkpoint):  # on the default device, as launch/generate.py loads it
            from tiderl_jax.model.gguf_io import load_gguf_model, open_gguf, read_gguf_config
            reader = open_gguf(cfg.checkpoint)
            model = load_gguf_model(reader, read_gguf_config(reader))
        else:
            from tiderl_jax.model.hf_io import load_hf_checkpoint
            model = load_hf_checkpoint(cfg.checkpoint)
        graphdef, params = nnx.split(model)
        engines = [Engine(model, engine_cfg)] + [
            Engine(model_on(graphdef, params, make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, [d]),
                            config_lib.sharding_rules(cfg)), engine_cfg) for d in devices[1:FLAGS.replicas]]
    if tokenizer.vocab_size > engines[0].model_cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} ids, the model {engines[0].model_cfg.vocab_size}")
    name = FLAGS.served_model_name or os.path.basename(os.path.normpath(FLAGS.checkpoint))
    return engines, tokenizer, name


async def _serve(engines, tokenizer, name):
    from tiderl_jax.serving.openai_api.app import HTTPServer
    from tiderl_jax.serving.openai_api.frontend import Frontend, ServerLimits
    from tiderl_jax.serving.service import RolloutService, ServiceConfig

    service = RolloutService(engines, ServiceConfig(policy=FLAGS.router))
    pin = (lambda rep, h: rep.engine.pin(h)) if FLAGS.kv_mode == "ctb" else (lambda rep, h: None)
    await service.start(on_turn_end=pin)
    limits = ServerLimits(max_body_bytes=FLAGS.max_body_bytes, max_tokens=FLAGS.max_tokens,
                          max_inflight=FLAGS.max_inflight, session_ttl_s=FLAGS.session_ttl_s)
    frontend = Frontend(service, tokenizer, model_name=name, limits=limits, kv_mode=FLAGS.kv_mode,
                        api_key=FLAGS.api_key, chatml_tools=FLAGS.chatml_tools)
    server = HTTPServer(frontend, FLAGS.host, FLAGS.port, drain_s=FLAGS.drain_s)
    try:
        await server.start()
    except OSError as e:
        await service.stop()
        _fail(str(e))
    print(f"serving {name!r} ({len(engines)} replica(s), context {frontend.max_context}) at {server.base_url}",
          flush=True)
    try:
        await asyncio.Event().wait()  # until Ctrl-C or SIGTERM (asyncio cancels this task)
    except asyncio.CancelledError:
        print(f"{interrupts.name()}: draining: new connections refused, {frontend.inflight} completion(s) in flight "
              f"get up to {FLAGS.drain_s:g}s", flush=True)
        raise
    finally:
        await server.stop()
        await service.stop()


def main(argv):
    console.setup()
    interrupts.install()  # SIGTERM drains as Ctrl-C does
    if len(argv) > 1:
        _fail(f"unexpected arguments: {' '.join(argv[1:])}")
    _check_flags()
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        _fail(f"the server needs {', '.join(missing)}: pip install -e '.[serve]'")
    try:
        from tiderl_jax.serving.service import ServiceConfig
        ServiceConfig(policy=FLAGS.router)
        engines, tokenizer, name = _build()
    except (ConfigError, ValueError) as e:
        _fail(str(e))
    if FLAGS.warmup:
        for e in engines:
            logging.info("warm-up compiled in %.1fs", e.warmup())
    try:
        asyncio.run(_serve(engines, tokenizer, name))
    except KeyboardInterrupt:  # the first signal drained (`_serve`), a second one stopped it at once
        print(f"stopped by {interrupts.name()}", flush=True)


if __name__ == "__main__":
    app.run(distributed.single_process_main(main, "launch/serve.py"))
