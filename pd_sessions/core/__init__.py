"""The pure core: errors, frozen configs and their loading, the planner, connector support and
preflight decisions, the checks' contract (results, registry), inventory types, the command
line's options. It reads no environment, touches no process, socket or GPU, and imports only the
standard library, ``packaging`` and itself (the ``core is pure`` contract in pyproject.toml)."""
