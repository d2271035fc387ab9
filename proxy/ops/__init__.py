"""Operating the sidecar: metrics, logs, health and status pages, miss explanations, the demo and
explain commands.
"""
