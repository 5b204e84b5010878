"""Host operations per decoder layer of a prefill step and a decode step: the same steps run
by runners of two layer counts, counted (engine/host_ops.OpCounter), the difference divided
by the layers between them. The step's own work (batch and metadata, sampling, the copy of
its results) and the one-off work of its first indexer layer (the step plan it shares with
the others) cancel out; what is left is what each further layer adds.

On a CPU the runners' steps take the GPU path's branches with every Triton launch counted,
not run (`gpu_branches`, `stub_launches`); on a GPU they run.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from dsaserve.bench import steps
from dsaserve.core import SchedulerOutput
from dsaserve.engine.host_ops import OpCounter, gpu_branches, ops_per_layer
from dsaserve.engine.runner import ModelRunner


@dataclass(frozen=True)
class StepOps:
    """One kind of step counted at two layer counts."""

    kind: str  # "prefill" | "decode"
    layers: tuple[int, int]
    ops: tuple[int, int]  # torch ops of the whole step, at each layer count
    launches: tuple[int, int]  # Triton launches of the whole step
    ops_per_layer: float
    launches_per_layer: float
    growth: Counter[str]  # "site  op" → what the extra layers added (ops and launches)

    def report(self, top: int = 30) -> str:
        """The sites that grow with layers, per layer, most first."""
        span = self.layers[1] - self.layers[0]
        return "\n".join(f"{n / span:6.1f}  {site}" for site, n in self.growth.most_common(top))


def _counted(runner: ModelRunner, so: SchedulerOutput, stub: bool) -> OpCounter:
    with OpCounter(runner.model.model.layers, stub_launches=stub) as ops:
        runner.execute(so)
    return ops


def count_steps(make_runner: Callable[[int], ModelRunner], layers: tuple[int, int],
                prompt_len: int, context: int, batch: int, stub: bool
                ) -> tuple[StepOps, StepOps]:
    """(prefill, decode) StepOps: a prefill of one `prompt_len`-token prompt, and an eager
    decode step of `batch` requests at `context` tokens, each counted after one like it
    (first-use work left out). make_runner(L) → a runner of L decoder layers (eager decode:
    --enforce-eager) with blocks for both. stub: on a CPU, the GPU path's host code with its
    launches counted, not run."""
    counted: dict[str, list[OpCounter]] = {"prefill": [], "decode": []}
    for num_layers in layers:
        runner = make_runner(num_layers)
        vocab, block = runner.config.model.vocab_size, runner.block_size
        with gpu_branches() if stub else contextlib.nullcontext():
            _counted(runner, steps.prefill(prompt_len, vocab, block, "warm"), stub)
            counted["prefill"].append(_counted(runner, steps.prefill(
                prompt_len, vocab, block, "counted", seed=1, finished=("warm-0",)), stub))
            first, again = steps.decode(context, batch, vocab, block)
            done = SchedulerOutput((), (), {}, ("counted-0",))
            for so in (done, first, again):
                _counted(runner, so, stub)
            counted["decode"].append(_counted(runner, again, stub))
        del runner
    out = []
    for kind, (small, large) in counted.items():
        per_op, per_launch, growth = ops_per_layer(small, large, layers, names=True)
        out.append(StepOps(kind, layers, (small.total()[0], large.total()[0]),
                           (small.total()[1], large.total()[1]), per_op, per_launch, growth))
    return out[0], out[1]
