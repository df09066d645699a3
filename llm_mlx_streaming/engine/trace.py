"""Records which experts each MoE layer routed to, per generation, for the simulator.

One JSON line per phase (prefill, decode) per generation, in the format
`experts/traces.py` reads, so `llm mlxs simulate` can judge eviction policies on the
user's own model and prompts.
"""

from __future__ import annotations

from pathlib import Path

from ..experts.traces import write_trace_line


class TraceRecorder:
    """Attached to a model's streaming layers for the length of one generation."""

    def __init__(self, layers, num_experts: int):
        self.layers = layers
        self.num_experts = num_experts
        self.decode: list[list] = [[] for _ in layers]
        self.prefill: list[list] = [[] for _ in layers]
        self.top_k = 0

    def __enter__(self) -> "TraceRecorder":
        for module in self.layers:
            module.observer = self.observe
        return self

    def __exit__(self, *exc) -> None:
        for module in self.layers:
            module.observer = None

    def observe(self, layer: int, needed, single_token: bool) -> None:
        ids = [int(e) for e in needed]
        if single_token:
            self.top_k = max(self.top_k, len(ids))
            self.decode[layer].append(ids)
        else:
            self.prefill[layer].append(ids)

    def write(self, path: Path, model: str) -> None:
        """Append this generation's lines to `path`."""
        path.parent.mkdir(parents=True, exist_ok=True)
        top_k = self.top_k or max((len(s) for seq in self.prefill for s in seq), default=0)
        with open(path, "a") as fh:
            for phase, seqs in (("prefill", self.prefill), ("decode", self.decode)):
                if any(seqs):
                    write_trace_line(fh, model=model, layers=len(self.layers), experts=self.num_experts,
                                     top_k=top_k, phase=phase, layer_seqs=seqs)
