"""The local handler: one request from its body to its answer (memory lease, plan, pump, record)."""
