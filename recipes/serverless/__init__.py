"""Serverless DiLoCo recipe: N replicas that share only an object store (``python -m recipes.serverless.run``)."""
