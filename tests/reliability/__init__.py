"""Reliability and security suite: every fault, bad input and attack of docs/reliability.md."""
