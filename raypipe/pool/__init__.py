"""The preprocessing pool: the policy that follows the trainer (`follow`), the Ray Data
autoscaler it drives (`autoscale`), and the watch of actors and nodes (`watch`).

Imports `raypipe.preprocess` and below.
"""
