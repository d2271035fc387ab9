"""The upstream side: the pooled WebSocket, the pool that executes the planner's decisions, HTTP
passthrough and egress.
"""
