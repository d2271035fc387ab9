"""Watching the sidecar run: every metric and its label sets, the access log, the recent misses,
the health probes and the status page. The shells write here; nothing here serves a request.
"""
