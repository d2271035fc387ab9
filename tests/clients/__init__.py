"""End-to-end client tests: real SDKs and raw HTTP through the sidecar, the emulator as upstream."""
