"""composer-replication: Composer-style agentic RL post-training."""
__version__ = "0.1.0"
