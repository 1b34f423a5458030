"""Installing: what an interpreter has (envfacts), the connector wheel decisions (install,
installed), the import canary, the wheelhouse, and the noxfile's helpers."""
