"""Layer 2 of deploy/: the local build side (snapshot, series, build, build manifest, pins,
refresh). No host is reached from here; checks/ (the quality gates) builds on this layer."""
