"""The operator's commands: ``upshift doctor`` (the upstream checked with the sidecar's own client
parts), ``upshift explain``, the demo and the generated reference docs (``python -m
proxy.ops.refdocs``). They sit above the shells and may use any of them; what watches the running
sidecar (metrics, logs, health, status) is :mod:`proxy.observe`.
"""
