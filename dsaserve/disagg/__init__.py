"""Prefill/decode disaggregation: KV re-layout plans (relayout), applying them to caches (kvio),
and moving the bytes between processes (transport)."""
