"""Pure decision functions of observed signals: no JAX, no threads, no I/O, no project imports.

The real runtime and the simulator call the same functions with the same signals
(docs/architecture.md, "The one idea").
"""
