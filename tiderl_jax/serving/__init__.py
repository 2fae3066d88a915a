"""The rollout service (`service.RolloutService`): N engine replicas behind a router, sessions routed by the
policies of `tiderl_jax.policies.routing`."""
