"""Speculative decoding: MTP drafting (mtp.py) and verification by rejection sampling
(rejection.py). docs/spec_decode.md describes the design."""
