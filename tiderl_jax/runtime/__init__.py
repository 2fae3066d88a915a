"""The controller, device pool and meshes, weight sync, metrics."""
