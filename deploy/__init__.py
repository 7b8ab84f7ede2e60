"""ddtree-deploy: the CLI and the machinery that builds, gates and ships the DDTree SGLang build."""

__version__ = "0.1.0"
