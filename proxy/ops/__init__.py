"""Operating the sidecar: metrics, logs, health and status pages, miss explanations, the demo,
explain and doctor commands.
"""
