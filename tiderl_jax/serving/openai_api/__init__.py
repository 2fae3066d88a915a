"""The OpenAI-compatible HTTP server over the rollout service (docs/serving.md): `protocol` (wire format,
errors), `frontend` (prompts, sessions, generation, keys, limits), `app` (FastAPI routes, `HTTPServer`),
`metrics` (Prometheus), `scoring` (top log-probs), `external` (external agents as a rollout source)."""
