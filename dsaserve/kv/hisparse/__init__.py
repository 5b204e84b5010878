"""Hybrid HiSparse decode (docs/hisparse.md): the MLA KV mirrored in a host pool, a per-request
hot buffer on the device that holds the rows the indexer selects."""
