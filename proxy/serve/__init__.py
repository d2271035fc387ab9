"""The local handler: one request from its body to its answer (identity, memory lease, plan, pump, record)."""
