# Cython declarations for replicas.py (the module stays plain Python: this file only types it when it is
# compiled; see setup.py and tiderl_jax/sim/__init__.py). Typed attributes make the replica event core
# (`ReplicaCore._wake` and what it calls) C struct accesses instead of dictionary lookups. `ReplicaCore`
# extends kv.pxd's `KVModel` (the KV model's attributes and C calls); `SimBackend` (backend.py, plain
# Python) extends it.

from tiderl_jax.sim.kv cimport KVModel, _Replica, _Seq, _Waiter

cdef class ReplicaCore(KVModel):
    cdef public long _chunk, _order, _events, _decode_tokens, _load_steps, _busy_replicas
    cdef public long _finished_window, _finishes, _host_jobs, _rollout_devices, _replica_devices, _train_extra, _rid
    cdef public double _load_busy, _load_prefill, _load_running, _load_queued, _span_busy, _armed_at
    cdef public double _call_overhead, _flops_rate, _decode_flops
    cdef public bint _busy_lane, _span_lane, _driving, _spec, _shared
    cdef public list _heap, _load_heap

    # the event core's steps: C calls (`_walk` stays a Python method: tests and sim_validation wrap it)
    cdef _wake(self, _Replica r)
    cdef _env_return(self, _Seq seq)
    cdef _Replica _pick(self)
    cdef _set_live(self, _Replica r, long delta)
    cdef _place(self, _Seq seq)
    cdef _enqueue(self, _Replica r, _Seq seq)
    cdef _arrived(self, _Replica r, double now)
    cdef _cut(self, _Replica r, double at)
    cdef _schedule(self, _Replica r, double at)
    cdef _retire(self, _Replica r, _Seq s)
    cdef _turn_end(self, _Replica r, _Seq s, double at)
    cdef _finish(self, _Replica r, _Seq s)
    cdef _drop_prompt(self, _Replica r, _Seq s)
    cdef _add_busy(self, _Replica r, double seconds)
    cdef _arm(self, double at)
    cdef _busy_end(self, _Replica r, double seconds)
