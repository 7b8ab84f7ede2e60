"""Quality gates run by `ddtree-deploy check` (one module per gate, a registry the CLI iterates)."""
