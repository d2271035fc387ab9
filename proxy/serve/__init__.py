"""The local handler: one request from its parsed body to its answer (plan, lease a lane, pump, record)."""
