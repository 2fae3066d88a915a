"""Worker for benchmarks/engine_throughput.py: runs workloads on an external system, prints JSON.

Runs under another Python (vLLM and transformers need torch, which our environment does not have):

    PYTHON benchmarks/_external_generate.py SPEC.json

SPEC: {"system": "vllm" | "hf", "checkpoint": DIR, "temperature": float, "max_model_len": int,
       "workloads": {name: [session, ...]}} with sessions as `_engine_workloads.py` describes them.
Turns are released at their times (relative to the start of each timed run); every turn generates
exactly its max_new_tokens (end-of-sequence ignored). Prints one line `RESULT {"startup_s": s,
"results": {name: {"output_tokens", "seconds", "ttft_p50_s", ..., "mean_batch"}}}`.

- vllm: `LLMEngine.add_request` when a turn is released, `step()` otherwise (continuous batching);
  a later turn of a session is a new request of its whole context (prefix caching on, so the
  context's earlier blocks are hits). One start-up for all workloads (reported as startup_s).
- hf: `transformers` `generate`. One-turn workloads: static batches of up to 16 requests in arrival
  order (all at once when every request is there at t=0 with one length), each batch left-padded
  and started when its last request has arrived. Multi-turn workloads: one plain `generate` per turn
  of the whole context, in release order (no KV reuse between turns, no batching).
"""

import heapq
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _engine_workloads import Tracker, output_tokens, static_batches  # noqa: E402


def run_vllm(spec):
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=spec["checkpoint"], skip_tokenizer_init=True, dtype="float32",
              max_model_len=spec["max_model_len"], enforce_eager=False, seed=0, enable_prefix_caching=True,
              gpu_memory_utilization=spec.get("memory_fraction", 0.3))
    startup = time.perf_counter() - t0
    engine = llm.llm_engine
    results = {}
    for name, sessions in spec["workloads"].items():
        # warm-up request (graphs, caches), not timed
        llm.generate([{"prompt_token_ids": sessions[0]["prompt"]}],
                     SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False), use_tqdm=False)
        tracker = Tracker()
        ready = [(s["arrival_s"], i, 0) for i, s in enumerate(sessions)]
        heapq.heapify(ready)
        context = {i: list(s["prompt"]) for i, s in enumerate(sessions)}
        live, left, tokens = {}, len(sessions), 0
        start = time.perf_counter()
        while left:
            now = time.perf_counter() - start
            while ready and ready[0][0] <= now:
                _, i, k = heapq.heappop(ready)
                turn = sessions[i]["turns"][k]
                sp = SamplingParams(temperature=spec["temperature"], max_tokens=turn["max_new_tokens"],
                                    ignore_eos=True, detokenize=False)
                engine.add_request(f"{i}:{k}", {"prompt_token_ids": list(context[i])}, sp)
                tracker.turn_started(f"{i}:{k}", now)
                live[f"{i}:{k}"] = (i, k)
            if not engine.has_unfinished_requests():
                time.sleep(min(0.002, max(0.0, ready[0][0] - now)) if ready else 0.001)
                continue
            outs = engine.step()
            t1 = time.perf_counter() - start
            counts = {}
            for out in outs:
                got = list(out.outputs[0].token_ids) if out.outputs else []
                counts[out.request_id] = len(got)
                if out.finished:
                    i, k = live.pop(out.request_id)
                    turn = sessions[i]["turns"][k]
                    tokens += len(got)
                    context[i] += got + list(turn["observation"])
                    if k + 1 < len(sessions[i]["turns"]):
                        heapq.heappush(ready, (t1 + turn["tool_s"], i, k + 1))
                    else:
                        left -= 1
            tracker.step(now, t1, counts)
        seconds = time.perf_counter() - start
        assert tokens == output_tokens(sessions), (tokens, output_tokens(sessions))
        results[name] = dict(output_tokens=tokens, seconds=seconds, **tracker.summary())
    return {"startup_s": startup, "results": results}


def _hf_generate(model, torch, prompts, n, temperature):
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=temperature > 0, temperature=temperature or None, top_k=0, pad_token_id=0)
    return out[:, width:].tolist()


def run_hf(spec):
    import torch
    import transformers

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.float32)
    model.eval()
    startup = time.perf_counter() - t0
    temp = spec["temperature"]
    results = {}
    for name, sessions in spec["workloads"].items():
        _hf_generate(model, torch, [sessions[0]["prompt"]], 4, temp)  # warm-up, not timed
        if max(len(s["turns"]) for s in sessions) == 1:
            tokens, seconds, tracker = static_batches(
                sessions, lambda prompts, n, _: _hf_generate(model, torch, prompts, n, temp))
            results[name] = dict(output_tokens=tokens, seconds=seconds, **tracker.summary())
            continue
        tracker, tokens = Tracker(), 0
        start = time.perf_counter()
        ready = [(s["arrival_s"], i, 0) for i, s in enumerate(sessions)]
        heapq.heapify(ready)
        context = {i: list(s["prompt"]) for i, s in enumerate(sessions)}
        while ready:
            at, i, k = heapq.heappop(ready)
            wait = at - (time.perf_counter() - start)
            if wait > 0:
                time.sleep(wait)
            turn = sessions[i]["turns"][k]
            b0 = time.perf_counter()
            got = _hf_generate(model, torch, [context[i]], turn["max_new_tokens"], temp)[0]
            done = time.perf_counter()
            tracker.static_batch([at], done - start, done - b0, len(got), len(got))
            tokens += len(got)
            context[i] += got + list(turn["observation"])
            if k + 1 < len(sessions[i]["turns"]):
                heapq.heappush(ready, (done - start + turn["tool_s"], i, k + 1))
        seconds = time.perf_counter() - start
        results[name] = dict(output_tokens=tokens, seconds=seconds, **tracker.summary())
    return {"startup_s": startup, "results": results}


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = {"vllm": run_vllm, "hf": run_hf}[spec["system"]](spec)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
