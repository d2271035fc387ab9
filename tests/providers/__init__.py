"""Providers and the network path: Azure OpenAI, gateways, forward proxies, private CAs, and a
third-party upstream (aimock)."""
