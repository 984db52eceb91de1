"""The default normalization recipe (default.yaml) for composer_replication.replaysim."""
