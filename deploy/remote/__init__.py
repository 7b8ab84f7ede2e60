"""Layer 3 of deploy/: everything that reaches a host (transport, the agent and its protocol,
facts, plan, the release transition, restart, health, lock, local records) and the serving
benchmark's HTTP client. Prints nothing: progress and warnings go through releases.Events."""
