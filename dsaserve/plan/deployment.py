"""`--deployment` specs of `dsaserve simulate`: one engine layout and its serving options, or a
prefill engine and a decode engine (P/D).

    dp8xep router=prefix             8 data-parallel replicas, experts sharded over all 8 GPUs
    dp8xep mtp=3 acceptance=2.99     the same with MTP3 at a synthetic acceptance length
    tp8                              one replica of 8 tensor-parallel ranks
    pcp8xdcp8xep8 offload=512GiB     one replica: PCP 8, DCP 8 over the same ranks, EP 8, a
                                     512 GiB host KV tier (64 GiB per rank)
    dp8xep hisparse host=48GiB       hybrid HiSparse decode: each replica's MLA rows in a 48 GiB
                                     host pool, admission by host capacity
    prefill=pcp8xdcp8xep8 offload=512GiB; decode=dp8xep hisparse host=48GiB mtp=3
        acceptance=2.99; router=prefix
                                     P/D: 8 GPUs of prefill, 8 of decode, the prompt's KV moved
                                     over the network; the router picks the prefill engine by
                                     prefix + load, the decode engine too (its own router= option
                                     overrides)

Layout terms join with `x`: dp, tp, pcp, dcp take a count; `ep` may carry one, which must equal
the GPUs its experts span (dp × pcp × tp). Options are `key=value`: router (prefix | load |
round-robin), kv (fp8_ds_mla | bf16), weights (fp8 | fp8-dsaserve | fp8-weight-only | bf16:
W8A8; FP8 weights with bf16 activations as dsaserve's engine runs them on CUDA, each product's
kernel by its rows; FP8 weights at the bf16 rate; or bf16), block-size, max-num-seqs,
max-num-batched-tokens, gpu-memory-utilization, offload=SIZE (GiB of host KV tier per replica, as
--kv-offloading-size), and mtp=K with acceptance=L (K MTP drafts per step accepted at vLLM's
synthetic rates for a mean acceptance length L) and draft-vocab=N (the drafts' head keeps N
tokens: --speculative-config's draft_vocab; give the acceptance measured with it),
max-model-len, and hisparse with host=SIZE (GiB of host pool per replica; each rank keeps the
whole pool, as the engine's host_pool_gib), hot-rows=N (hot-buffer rows per request and layer;
default (k + 2) × top-k, the engine's) and
overlap=F (the share of a step's selected rows that the previous step selected too; default 0.9),
enforce-eager (decode steps run eager, as the engine's --enforce-eager; default: replayed from
CUDA graphs, as the engine) and async-scheduling (the engine's host work overlaps the kernels:
a step lasts max(kernels, host) instead of their sum; the engine does this with DP, TP, DCP,
EP, PCP, HiSparse, the host KV tier and on both sides of P/D): see
docs/simulate.md for what is modelled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsaserve.config import ConfigError, ParallelConfig, SpecConfig
from dsaserve.plan import costmodel as cm

ROUTERS = ("prefix", "load", "round-robin")
DEFAULT_OVERLAP = 0.9  # consecutive steps' index sets (docs/hisparse.md measures 70-99 %)


@dataclass(frozen=True)
class Deployment:
    spec: str  # as given, for tables
    parallel: ParallelConfig  # data_parallel_size = replicas
    kv_dtype: cm.KVDType = "fp8_ds_mla"
    # the weight matrices in HBM and in the GEMMs (costmodel.WEIGHT_FORMATS): fp8 (block-scaled
    # weights and activations, as vLLM and SGLang serve the checkpoints), fp8-dsaserve
    # (dsaserve's engine on CUDA: each product at the rate of the kernel its rows take),
    # fp8-weight-only (FP8 weights at the bf16 rate) or bf16 (dequantized at load)
    weight_dtype: cm.WeightDType = "fp8"
    router: str = "prefix"
    block_size: int = 64
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    # MTP drafts per step, accepted at fixed synthetic rates (vLLM's benchmark mode), and the
    # tokens the drafts' head keeps (SpecConfig's draft_vocab; 0: every token)
    speculative: SpecConfig | None = None
    draft_vocab: int = 0
    offload_bytes: int = 0  # host KV tier of each replica, over its ranks (0: none)
    max_model_len: int | None = None  # None: the longest context the memory allows
    # Hybrid HiSparse: the host pool of each replica (0: off), hot rows per request and layer
    # (0: the engine's default (k + 2) × top-k, config.default_hot_rows), the index-set overlap
    # of consecutive decode steps
    hisparse_host_bytes: int = 0
    hot_rows: int = 0
    overlap: float = DEFAULT_OVERLAP
    # How the engine runs a step (plan/hosttime.py): decode from CUDA graphs unless
    # enforce_eager; host work after the kernels (synchronous, as built) unless async_scheduling
    enforce_eager: bool = False
    async_scheduling: bool = False

    @property
    def hisparse(self) -> bool:
        return self.hisparse_host_bytes > 0

    @property
    def num_gpus(self) -> int:
        return cm.num_gpus(self.parallel)

    @property
    def replicas(self) -> int:
        return self.parallel.data_parallel_size

    @property
    def lockstep(self) -> bool:
        """Replicas whose experts are sharded over each other step together (the engine's DP +
        EP, parallel/lockstep.py: idle replicas make row-less dispatches): a step lasts as long
        as the slowest rank."""
        return self.parallel.ep_spans_replicas


@dataclass(frozen=True)
class PDDeployment:
    """Prefill/decode disaggregation: two engines, the router in front of both (prefill picked
    by `router`, decode by the decode engine's own `router` option, `router` unless given, as
    `dsaserve router` picks both)."""

    spec: str
    prefill: Deployment
    decode: Deployment
    router: str = "prefix"

    @property
    def num_gpus(self) -> int:
        return self.prefill.num_gpus + self.decode.num_gpus


def parse_deployment(text: str) -> Deployment | PDDeployment:
    """One engine (`dp8xep router=prefix`) or P/D (`prefill=...; decode=...; router=...`)."""
    if ";" in text or text.lstrip().startswith(("prefill=", "decode=")):
        return _parse_pd(text)
    return _parse_engine(text, text)


def _parse_pd(text: str) -> PDDeployment:
    parts: dict[str, str] = {}
    for section in text.split(";"):
        key, sep, value = section.strip().partition("=")
        if not sep or key not in ("prefill", "decode", "router") or not value.strip():
            raise ConfigError(f"--deployment {text!r}: a P/D spec is 'prefill=LAYOUT [options]; "
                              f"decode=LAYOUT [options]; router=POLICY', got {section.strip()!r}")
        if key in parts:
            raise ConfigError(f"--deployment {text!r}: {key}= given twice")
        parts[key] = value.strip()
    missing = [k for k in ("prefill", "decode") if k not in parts]
    if missing:
        raise ConfigError(f"--deployment {text!r}: a P/D spec needs {' and '.join(missing)}=")
    router = parts.get("router", "prefix")
    if router not in ROUTERS:
        raise ConfigError(f"--deployment {text!r}: router must be one of {ROUTERS}")
    prefill_words = parts["prefill"].split()
    if not any(w.startswith("router=") for w in prefill_words):
        prefill_words.append(f"router={router}")  # the P/D router's policy picks the prefill
    prefill = _parse_engine(" ".join(prefill_words), text)
    decode_words = parts["decode"].split()
    if not any(w.startswith("router=") for w in decode_words):
        # the decode engine as `dsaserve router` picks it: by the same policy (prefix + load)
        decode_words.append(f"router={router}")
    decode = _parse_engine(" ".join(decode_words), text)
    if prefill.speculative is not None:
        raise ConfigError(f"--deployment {text!r}: mtp= belongs to the decode engine (the prefill "
                          "engine emits one token)")
    if prefill.hisparse:
        raise ConfigError(f"--deployment {text!r}: hisparse belongs to the decode engine")
    if prefill.kv_dtype != decode.kv_dtype:
        raise ConfigError(f"--deployment {text!r}: kv= must be the same on both engines (the "
                          "transfer copies rows as they are)")
    if prefill.block_size != decode.block_size:
        raise ConfigError(f"--deployment {text!r}: block-size= must be the same on both engines")
    return PDDeployment(spec=text, prefill=prefill, decode=decode, router=router)


def _parse_engine(text: str, spec: str) -> Deployment:
    """One engine's layout and options; errors quote the whole `spec`."""
    words = text.split()
    if not words:
        raise ConfigError(f"--deployment {spec!r}: empty spec (e.g. 'dp8xep router=prefix')")
    sizes = {"dp": 1, "tp": 1, "pcp": 1, "dcp": 1}
    ep: int | None = None
    for term in words[0].lower().split("x"):
        match = re.fullmatch(r"(dp|tp|pcp|dcp|ep)(\d*)", term)
        if not match or (match[1] != "ep" and not match[2]) or match[2] == "0":
            raise ConfigError(f"--deployment {spec!r}: bad layout term {term!r} (dp8, tp8, pcp8, "
                              "dcp8, ep or ep8, joined by 'x')")
        if match[1] == "ep":
            ep = int(match[2]) if match[2] else 0
        else:
            sizes[match[1]] = int(match[2])
    options: dict[str, str] = {}
    flags: dict[str, object] = {}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if word == "hisparse":
            options["hisparse"] = "on"
            continue
        if word in ("enforce-eager", "async-scheduling"):
            flags[word.replace("-", "_")] = True
            continue
        if not sep or not value:
            raise ConfigError(f"--deployment {spec!r}: expected key=value, got {word!r}")
        options[key] = value
    try:
        parallel = ParallelConfig(
            tensor_parallel_size=sizes["tp"], prefill_context_parallel_size=sizes["pcp"],
            decode_context_parallel_size=sizes["dcp"], data_parallel_size=sizes["dp"],
            enable_expert_parallel=ep is not None)
    except ConfigError as e:
        raise ConfigError(f"--deployment {spec!r}: {e}") from None
    if ep and ep != cm.num_gpus(parallel):
        raise ConfigError(f"--deployment {spec!r}: ep{ep} must span all {cm.num_gpus(parallel)} "
                          "GPUs of the deployment (dp × pcp × tp)")
    kwargs: dict[str, object] = {}
    mtp, acceptance = options.pop("mtp", None), options.pop("acceptance", None)
    if (mtp is None) != (acceptance is None):
        raise ConfigError(f"--deployment {spec!r}: mtp=K and acceptance=L go together (L: the "
                          "synthetic mean acceptance length, e.g. mtp=3 acceptance=2.99)")
    if mtp is not None and acceptance is not None:
        k = int(_number(spec, "mtp", mtp, int))
        length = float(_number(spec, "acceptance", acceptance, float))
        if not 1.0 <= length <= k + 1:
            raise ConfigError(f"--deployment {spec!r}: acceptance must lie in [1, mtp + 1] = "
                              f"[1, {k + 1}], got {length}")
        try:
            kwargs["speculative"] = SpecConfig(
                num_speculative_tokens=k, rejection_sample_method="synthetic",
                synthetic_acceptance_rates=SpecConfig.acceptance_length_to_rates(length, k))
        except ConfigError as e:
            raise ConfigError(f"--deployment {spec!r}: {e}") from None
    for key, value in options.items():
        field_name = key.replace("-", "_")
        if key == "router":
            if value not in ROUTERS:
                raise ConfigError(f"--deployment {spec!r}: router must be one of {ROUTERS}")
            kwargs["router"] = value
        elif key == "kv":
            if value not in cm.KV_DTYPES:
                raise ConfigError(f"--deployment {spec!r}: kv must be one of {cm.KV_DTYPES}")
            kwargs["kv_dtype"] = value
        elif key == "weights":
            if value not in cm.WEIGHT_DTYPES:
                raise ConfigError(f"--deployment {spec!r}: weights must be one of "
                                  f"{cm.WEIGHT_DTYPES}")
            kwargs["weight_dtype"] = value
        elif field_name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            kwargs[field_name] = _number(spec, key, value, int)
        elif key in ("offload", "host"):
            size = int(_number(spec, key, value.removesuffix("GiB").removesuffix("G"), float)
                       * 2**30)
            kwargs["offload_bytes" if key == "offload" else "hisparse_host_bytes"] = size
        elif field_name in ("gpu_memory_utilization", "overlap"):
            kwargs[field_name] = _number(spec, key, value, float)
        elif field_name in ("max_model_len", "hot_rows"):
            kwargs[field_name] = _number(spec, key, value, int)
        elif key == "draft-vocab":
            if mtp is None:
                raise ConfigError(f"--deployment {spec!r}: draft-vocab=N needs mtp=K")
            kwargs["draft_vocab"] = _number(spec, key, value, int)
        elif key != "hisparse":
            raise ConfigError(f"--deployment {spec!r}: unknown option {key!r} (router, kv, "
                              "weights, block-size, max-num-seqs, max-num-batched-tokens, "
                              "max-model-len, "
                              "gpu-memory-utilization, offload, mtp, acceptance, draft-vocab, "
                              "hisparse, host, hot-rows, overlap, enforce-eager, "
                              "async-scheduling)")
    _check_hisparse(spec, "hisparse" in options, parallel, kwargs)
    return Deployment(spec=text, parallel=parallel, **kwargs, **flags)  # type: ignore[arg-type]


def _check_hisparse(text: str, on: bool, parallel: ParallelConfig,
                    kwargs: dict[str, object]) -> None:
    """hisparse needs host=; host=, hot-rows= and overlap= need hisparse; the engine's own
    start-up rules (docs/hisparse.md): no DCP, no PCP."""
    if not on:
        names = {"hisparse_host_bytes": "host", "hot_rows": "hot-rows", "overlap": "overlap"}
        given = [name for key, name in names.items() if key in kwargs]
        if given:
            raise ConfigError(f"--deployment {text!r}: {given[0]}= needs hisparse")
        return
    if "hisparse_host_bytes" not in kwargs:
        raise ConfigError(f"--deployment {text!r}: hisparse needs host=SIZE (GiB of host pool "
                          "per replica, e.g. host=48GiB)")
    if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        raise ConfigError(f"--deployment {text!r}: hisparse is for decode engines without PCP "
                          "or DCP (as the engine's --kv-transfer-config HiSparseConnector)")
    overlap = kwargs.get("overlap", DEFAULT_OVERLAP)
    if not 0.0 < overlap <= 1.0:  # type: ignore[operator]
        raise ConfigError(f"--deployment {text!r}: overlap must lie in (0, 1], got {overlap}")


def _number(text: str, key: str, value: str, cast: type) -> int | float:
    try:
        number = cast(value)
    except ValueError:
        number = 0
    if not number > 0:
        raise ConfigError(f"--deployment {text!r}: {key} must be a positive number, got {value!r}")
    return number
