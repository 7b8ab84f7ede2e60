"""Layer 1 of deploy/: the inventory (hosts.toml) and the pure launch-flag rules. No host, no
build, no output: imported by every layer above."""
