"""The edges: spawn and stop (process), the parent-death watch and the reaper, ports, HTTP,
readiness, the cluster context manager, host detection, the tiny models, the console."""
