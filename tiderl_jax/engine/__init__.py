"""The rollout engine: JetStream-style verbs and a continuous-batching engine over a paged KV pool."""
