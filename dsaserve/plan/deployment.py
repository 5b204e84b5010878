"""`--deployment` specs of `dsaserve simulate`: one engine layout and its serving options.

    dp8xep router=prefix             8 data-parallel replicas, experts sharded over all 8 GPUs
    dp8xep mtp=3 acceptance=2.99     the same with MTP3 at a synthetic acceptance length
    tp8                              one replica of 8 tensor-parallel ranks
    pcp8xdcp8xep8 offload=512GiB     one replica: PCP 8, DCP 8 over the same ranks, EP 8, a
                                     512 GiB host KV tier (64 GiB per rank)

Layout terms join with `x`: dp, tp, pcp, dcp take a count; `ep` may carry one, which must equal
the GPUs its experts span (dp × pcp × tp). Options are `key=value`: router (prefix | load |
round-robin), kv (fp8_ds_mla | bf16), block-size, max-num-seqs, max-num-batched-tokens,
gpu-memory-utilization, offload=SIZE (GiB of host KV tier per replica, as
--kv-offloading-size), and mtp=K with acceptance=L (K MTP drafts per step accepted at vLLM's
synthetic rates for a mean acceptance length L).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsaserve.config import ConfigError, ParallelConfig, SpecConfig
from dsaserve.plan import costmodel as cm

ROUTERS = ("prefix", "load", "round-robin")
# Parts of the reference deployment that arrive with later work; named so the error says so.
_NOT_YET = {
    "prefill": "prefill/decode disaggregation", "decode": "prefill/decode disaggregation",
    "hisparse": "hybrid HiSparse", "host": "hybrid HiSparse",
}


@dataclass(frozen=True)
class Deployment:
    spec: str  # as given, for tables
    parallel: ParallelConfig  # data_parallel_size = replicas
    kv_dtype: cm.KVDType = "fp8_ds_mla"
    router: str = "prefix"
    block_size: int = 64
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    # MTP drafts per step, accepted at fixed synthetic rates (vLLM's benchmark mode)
    speculative: SpecConfig | None = None
    offload_bytes: int = 0  # host KV tier of each replica, over its ranks (0: none)

    @property
    def num_gpus(self) -> int:
        return cm.num_gpus(self.parallel)

    @property
    def replicas(self) -> int:
        return self.parallel.data_parallel_size

    @property
    def lockstep(self) -> bool:
        """Replicas whose experts are sharded over each other step together (as vLLM's DP+EP
        does, idle ranks running a dummy batch): a step lasts as long as the slowest rank."""
        return self.parallel.enable_expert_parallel and self.replicas > 1


def parse_deployment(text: str) -> Deployment:
    words = text.split()
    if not words:
        raise ConfigError("--deployment: empty spec (e.g. 'dp8xep router=prefix')")
    sizes = {"dp": 1, "tp": 1, "pcp": 1, "dcp": 1}
    ep: int | None = None
    for term in words[0].lower().split("x"):
        match = re.fullmatch(r"(dp|tp|pcp|dcp|ep)(\d*)", term)
        if not match or (match[1] != "ep" and not match[2]) or match[2] == "0":
            raise ConfigError(f"--deployment {text!r}: bad layout term {term!r} (dp8, tp8, pcp8, "
                              "dcp8, ep or ep8, joined by 'x')")
        if match[1] == "ep":
            ep = int(match[2]) if match[2] else 0
        else:
            sizes[match[1]] = int(match[2])
    options: dict[str, str] = {}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if key in _NOT_YET:
            raise ConfigError(f"--deployment {text!r}: {key!r} is not simulated yet (it comes "
                              f"with {_NOT_YET[key]})")
        if not sep or not value:
            raise ConfigError(f"--deployment {text!r}: expected key=value, got {word!r}")
        options[key] = value
    try:
        parallel = ParallelConfig(
            tensor_parallel_size=sizes["tp"], prefill_context_parallel_size=sizes["pcp"],
            decode_context_parallel_size=sizes["dcp"], data_parallel_size=sizes["dp"],
            enable_expert_parallel=ep is not None)
    except ConfigError as e:
        raise ConfigError(f"--deployment {text!r}: {e}") from None
    if ep and ep != cm.num_gpus(parallel):
        raise ConfigError(f"--deployment {text!r}: ep{ep} must span all {cm.num_gpus(parallel)} "
                          "GPUs of the deployment (dp × pcp × tp)")
    kwargs: dict[str, object] = {}
    mtp, acceptance = options.pop("mtp", None), options.pop("acceptance", None)
    if (mtp is None) != (acceptance is None):
        raise ConfigError(f"--deployment {text!r}: mtp=K and acceptance=L go together (L: the "
                          "synthetic mean acceptance length, e.g. mtp=3 acceptance=2.99)")
    if mtp is not None and acceptance is not None:
        k = int(_number(text, "mtp", mtp, int))
        length = float(_number(text, "acceptance", acceptance, float))
        if not 1.0 <= length <= k + 1:
            raise ConfigError(f"--deployment {text!r}: acceptance must lie in [1, mtp + 1] = "
                              f"[1, {k + 1}], got {length}")
        try:
            kwargs["speculative"] = SpecConfig(
                num_speculative_tokens=k, rejection_sample_method="synthetic",
                synthetic_acceptance_rates=SpecConfig.acceptance_length_to_rates(length, k))
        except ConfigError as e:
            raise ConfigError(f"--deployment {text!r}: {e}") from None
    for key, value in options.items():
        field_name = key.replace("-", "_")
        if key == "router":
            if value not in ROUTERS:
                raise ConfigError(f"--deployment {text!r}: router must be one of {ROUTERS}")
            kwargs["router"] = value
        elif key == "kv":
            if value not in cm.KV_DTYPES:
                raise ConfigError(f"--deployment {text!r}: kv must be one of {cm.KV_DTYPES}")
            kwargs["kv_dtype"] = value
        elif field_name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            kwargs[field_name] = _number(text, key, value, int)
        elif key == "offload":
            size = value.removesuffix("GiB").removesuffix("G")
            kwargs["offload_bytes"] = int(_number(text, key, size, float) * 2**30)
        elif field_name == "gpu_memory_utilization":
            kwargs[field_name] = _number(text, key, value, float)
        else:
            raise ConfigError(f"--deployment {text!r}: unknown option {key!r} (router, kv, "
                              "block-size, max-num-seqs, max-num-batched-tokens, "
                              "gpu-memory-utilization, offload, mtp, acceptance)")
    return Deployment(spec=text, parallel=parallel, **kwargs)  # type: ignore[arg-type]


def _number(text: str, key: str, value: str, cast: type) -> int | float:
    try:
        number = cast(value)
    except ValueError:
        number = 0
    if not number > 0:
        raise ConfigError(f"--deployment {text!r}: {key} must be a positive number, got {value!r}")
    return number
