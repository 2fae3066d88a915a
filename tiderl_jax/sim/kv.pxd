# Cython declarations for kv.py (the module stays plain Python: this file only types it when it is
# compiled; see setup.py and tiderl_jax/sim/__init__.py). Typed attributes make the replica event core
# (replicas.py: `ReplicaCore._wake` and what it calls) C struct accesses instead of dictionary lookups.
# replicas.pxd cimports these classes; its `ReplicaCore` extends `KVModel`, and `SimBackend` (backend.py,
# plain Python) extends that.

cdef class _Replica

cdef class _Waiter:
    cdef public object future
    cdef public long left

cdef class _Seq:
    cdef public long gid, sample, prompt, turn, left, ctx, written, kv_pages, footprint, tokens_added, new_tokens
    cdef public long start, end, ctx0, run, kv_version, pf_left, pf_done
    cdef public tuple gen, obs, latency
    cdef public object shape, future
    cdef public dict versions
    cdef public _Replica replica
    cdef public bint pinned, admitted
    cdef public double wait_started, born
    cdef public str cls

cdef class _Replica:
    cdef public long rid, capacity, version, steps, maxend, ctx_base, used, cache_pages, footprints, live, events
    cdef public long w_step, w_chunks, w_first, span_steps, span_batch, span_ctx_base, span_maxend, span_first_end
    cdef public object devices, pending, queue, cache, prefilling
    cdef public dict running, pinned, prompts
    cdef public list ends, vlog, arrivals
    cdef public tuple prefix_at
    cdef public set programs
    cdef public bint alive, borrowed, busy, retry, one_step
    cdef public double wake_at, w_prev, w_dur, w_start, w_prefill, w_step_s, span_start, span_prefill
    # what the router reads (SimConfig.router): tokens processed, busy seconds, prompt / cached prompt tokens
    cdef public long r_tokens, r_prompt, r_cached, r_seen_prompt, r_seen_cached
    cdef public double r_busy

cdef class KVModel:
    cdef dict __dict__
    # the backend's state the KV model reads (ReplicaCore declares the event core's)
    cdef public long ps, _admissions, _prompt_tokens, _prompt_tokens_cached, _prefill_tokens
    cdef public long _max_batch, _shared_prefix, _prefill_budget, _prefill_row_cap
    cdef public double _program_s, _prefill_rate, _bytes_rate, _attn_per_pair, _param_bytes, _matmul_params
    cdef public double _kv_bytes, _mean_latency
    cdef public bint _ctb, _engine_steps, _routing
    cdef public object loop, measured, cfg, counters

    # admission and prefill: C calls of the event core
    cdef object _footprint(self, _Seq seq)
    cdef object _free(self, _Replica r)
    cdef _evict_cache(self, _Replica r, long need, _Seq keep)
    cdef double _admit(self, _Replica r)
    cdef _start(self, _Replica r, _Seq s)
    cdef double _program(self, _Replica r, tuple key)
    cdef double _prefill_time(self, long n, long c, double pairs, long calls=*)
