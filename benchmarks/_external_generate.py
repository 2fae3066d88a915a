"""Worker for benchmarks/engine_throughput.py: runs one workload on an external system, prints JSON.

Runs under another Python (vLLM and transformers need torch, which our environment does not have):

    PYTHON benchmarks/_external_generate.py SPEC.json

SPEC: {"system": "vllm" | "hf", "checkpoint": DIR, "temperature": float, "max_model_len": int,
       "requests": [{"prompt": [ids], "max_new_tokens": int, "arrival_s": float}, ...]}
Requests are released at their arrival times (relative to the start of the timed run); every request
generates exactly max_new_tokens (end-of-sequence ignored). Prints one JSON object:
{"output_tokens", "seconds", "ttft_s": [per request], "startup_s"}.

- vllm: `LLMEngine.add_request` when a request arrives, `step()` otherwise (continuous batching).
- hf: `transformers` `generate`, static batches of up to 16 requests in arrival order, each batch
  left-padded and started when its last request has arrived (HF has no continuous batching).
"""

import json
import sys
import time


def run_vllm(spec):
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=spec["checkpoint"], skip_tokenizer_init=True, dtype="float32",
              max_model_len=spec["max_model_len"], enforce_eager=False, seed=0,
              gpu_memory_utilization=spec.get("memory_fraction", 0.3))
    startup = time.perf_counter() - t0
    engine = llm.llm_engine
    reqs = spec["requests"]
    # warm-up request (graphs, caches), not timed
    llm.generate([{"prompt_token_ids": reqs[0]["prompt"]}],
                 SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False), use_tqdm=False)
    order = sorted(range(len(reqs)), key=lambda i: reqs[i]["arrival_s"])
    first = {}
    done = set()
    tokens = 0
    nxt = 0
    start = time.perf_counter()
    while len(done) < len(reqs):
        now = time.perf_counter() - start
        while nxt < len(order) and reqs[order[nxt]]["arrival_s"] <= now:
            i = order[nxt]
            sp = SamplingParams(temperature=spec["temperature"], max_tokens=reqs[i]["max_new_tokens"],
                                ignore_eos=True, detokenize=False)
            engine.add_request(str(i), {"prompt_token_ids": reqs[i]["prompt"]}, sp)
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(0.001)
            continue
        for out in engine.step():
            i = int(out.request_id)
            if i not in first and out.outputs and len(out.outputs[0].token_ids) > 0:
                first[i] = time.perf_counter() - start - reqs[i]["arrival_s"]
            if out.finished:
                done.add(i)
                tokens += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    return {"output_tokens": tokens, "seconds": seconds,
            "ttft_s": [first.get(i) for i in range(len(reqs))], "startup_s": startup}


def run_hf(spec):
    import torch
    import transformers

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.float32)
    model.eval()
    startup = time.perf_counter() - t0
    reqs = spec["requests"]
    order = sorted(range(len(reqs)), key=lambda i: reqs[i]["arrival_s"])
    batch_size = 16 if len(reqs) > 16 and len({r["max_new_tokens"] for r in reqs}) > 1 else len(reqs)
    ttft = [None] * len(reqs)
    tokens = 0
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        wait = max(reqs[i]["arrival_s"] for i in idx) - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        width = max(len(reqs[i]["prompt"]) for i in idx)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            p = reqs[i]["prompt"]
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        n = max(reqs[i]["max_new_tokens"] for i in idx)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=spec["temperature"] > 0, temperature=spec["temperature"] or None,
                           top_k=0, pad_token_id=0)
        tokens += sum(reqs[i]["max_new_tokens"] for i in idx)  # useful tokens only
    seconds = time.perf_counter() - start
    return {"output_tokens": tokens, "seconds": seconds, "ttft_s": ttft, "startup_s": startup}


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = {"vllm": run_vllm, "hf": run_hf}[spec["system"]](spec)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
