# Cython declarations for backend.py (the module stays plain Python: this file only types it when it is
# compiled; see setup.py and tiderl_jax/sim/__init__.py). Typed attributes make the replica event core
# (`SimBackend._wake` and what it calls) C struct accesses instead of dictionary lookups.

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
    cdef public double wait_started

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

cdef class SimBackend:
    cdef dict __dict__
    cdef public long ps, _chunk, _order, _admissions, _events, _decode_tokens, _prompt_tokens, _prompt_tokens_cached
    cdef public long _prefill_tokens, _load_steps, _busy_replicas
    cdef public long _max_batch, _finished_window, _shared_prefix, _finishes, _host_jobs, _rollout_devices
    cdef public long _replica_devices, _train_extra, _rid, _prefill_budget, _prefill_row_cap
    cdef public double _load_busy, _load_prefill, _load_running, _load_queued, _span_busy, _armed_at
    cdef public double _call_overhead, _program_s, _flops_rate, _prefill_rate, _bytes_rate, _attn_per_pair
    cdef public double _decode_flops, _param_bytes, _matmul_params, _kv_bytes, _mean_latency
    cdef public bint _ctb, _engine_steps, _busy_lane, _span_lane, _driving, _spec, _shared
    cdef public object loop, measured, cfg, counters
    cdef public list _heap, _load_heap

    # the event core's steps: C calls (`_walk` stays a Python method: tests and sim_validation wrap it)
    cdef _wake(self, _Replica r)
    cdef _env_return(self, _Seq seq)
    cdef _Replica _pick(self)
    cdef _set_live(self, _Replica r, long delta)
    cdef _place(self, _Seq seq)
    cdef _enqueue(self, _Replica r, _Seq seq)
    cdef object _footprint(self, _Seq seq)
    cdef object _free(self, _Replica r)
    cdef _evict_cache(self, _Replica r, long need, _Seq keep)
    cdef double _admit(self, _Replica r)
    cdef _start(self, _Replica r, _Seq s)
    cdef double _program(self, _Replica r, tuple key)
    cdef double _prefill_time(self, long n, long c, double pairs, long calls=*)
    cdef _arrived(self, _Replica r, double now)
    cdef _cut(self, _Replica r, double at)
    cdef _schedule(self, _Replica r, double at)
    cdef _retire(self, _Replica r, _Seq s)
    cdef _turn_end(self, _Replica r, _Seq s, double at)
    cdef _finish(self, _Replica r, _Seq s)
    cdef _add_busy(self, _Replica r, double seconds)
    cdef _arm(self, double at)
    cdef _busy_end(self, _Replica r, double seconds)
