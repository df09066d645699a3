"""What a caller asks the engine for: a checkpoint to have loaded, and one generation.

A request is complete in itself, so "load if needed, then generate" is a single locked
operation on the engine: nothing about a response depends on engine state that
another thread could change between two calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

from ..experts.policies import DEFAULT_POLICY
from .footprint import PREFILL_STEP
from .kv import FULL_PRECISION, KVSpec

if TYPE_CHECKING:
    from .footprint import Footprint

Slots = Union[int, Sequence[int], None]  # one count, one per MoE layer, or a slot per expert


@dataclass(frozen=True)
class LoadSpec:
    """The checkpoint and how its experts are pooled and read (None: the loader's default)."""

    path: Path
    expert_slots: Slots = None
    policy: str = DEFAULT_POLICY
    threads: Optional[int] = None
    page_cache: Optional[str] = None
    overlap: Optional[str] = None  # "auto" | "on" | "off" (experts/prefetch.py)
    packed: Optional[bool] = None
    buffer_cache: Optional[int] = None  # bytes of freed buffers MLX keeps for reuse (engine/memory.py)
    footprint: Optional["Footprint"] = None  # what the model holds beside its pools (engine/sharing.py); None: unbudgeted


@dataclass(frozen=True)
class Injected:
    """What tests and benchmarks hand the engine in place of its own parts; requests
    from the model, the CLI and the server leave it empty."""

    drafter: Any = None  # a ready Drafter; wins over `Request.draft`
    after_verify: Optional[Callable] = None  # called with (inputs, kept) after each verify pass


@dataclass(frozen=True)
class Sampling:
    """How each token is drawn from the logits: mlx-lm's sampler settings, and a seed
    that applies to one generation alone."""

    temperature: float = 0.0
    top_p: float = 0.0
    min_p: float = 0.0
    top_k: int = 0
    seed: Optional[int] = None


@dataclass(frozen=True)
class VisionInput:
    """A prompt's images as the model's processor made them: the pixels, the arrays the
    model reads beside them (grid sizes, ...), and each image's sha256 in prompt order,
    so a cached prefix is reused only for the same images (engine/prompt_cache.py)."""

    pixel_values: Any
    arrays: dict
    digests: tuple[str, ...]


@dataclass
class Request:
    """One generation.

    `prompt` is the token ids, rendered by the caller with the checkpoint's tokenizer.
    Sampling is built inside the engine from the fields below, so a seed applies to
    this generation alone; `sampler` replaces them when given. `max_tokens` below 1
    means "until the context is full".
    """

    prompt: Sequence[int]
    max_tokens: Optional[int] = None
    sampling: Sampling = Sampling()
    sampler: Optional[Callable] = None  # replaces `sampling` when given (tests, benchmarks)
    # when set, each response's `logprobs` is (its token's log-probability, [(id, log-probability)]
    # of this many most likely tokens), computed on the engine thread
    top_logprobs: Optional[int] = None
    logits_processors: list = field(default_factory=list)
    # processors.Budgeted ones (also in logits_processors) told the reply's token budget
    # before the first token: a schema constraint closes its document within it
    budget_aware: Sequence = ()
    max_context: Optional[int] = None  # a user limit below the model's own context
    trace_path: Optional[Path] = None  # when set, this generation's routing is appended here
    # -- features --
    stop: Sequence[str] = ()  # the reply ends before the first of these in its text
    conversation_cache: Optional[Any] = None  # engine.disk_cache.DiskCacheSpec: save/load KV on disk
    snapshots: Optional[Any] = None  # engine.snapshots.SnapshotSpec: resume caches that cannot be rewound
    boundaries: Sequence = ()  # engine.snapshots.Boundary: where the rendered prompt's stable parts end
    # -- speculation --------------------------------------------------
    k: Union[int, str] = 0  # drafts per verify pass; 0: plain mlx-lm decoding; "auto": adaptive
    draft: str = "ngram"  # a drafter kind (speculation/drafter.py) or an added model's name
    draft_path: Optional[Path] = None  # checkpoint of `draft` when it names an added model
    injected: Injected = Injected()  # tests' and benchmarks' stand-ins
    # -- long context (engine/kv.py) --
    kv: KVSpec = FULL_PRECISION  # how the attention cache is kept (quantized or not)
    # prompt tokens per model call of the prefill (engine/prefill.py): a number, or for auto
    # the model's engine/planner.ExpertChunk, which sizes it by the prompt; None: mlx-lm's 2048
    prefill_step: Union[int, Any, None] = None
    max_batch: int = 1  # the largest batch it may join (engine/batch.py); 1: it runs alone
    vision: Optional[VisionInput] = None  # the prompt's images (a vision-language model)

    def chunk(self, prompt: int, held: int = 0) -> int:
        """Prompt tokens per model call of the prefill of a `prompt`-token prompt, with
        `held` bytes of other sequences' caches beside it."""
        step = self.prefill_step
        if step is None:
            return PREFILL_STEP
        return step if isinstance(step, int) else step.tokens(prompt, held)

    def make_sampler(self):
        import mlx.core as mx
        from mlx_lm.sample_utils import make_sampler

        if self.sampler is not None:
            return self.sampler
        sampling = self.sampling
        if sampling.seed is not None:
            mx.random.seed(sampling.seed)
        return make_sampler(sampling.temperature, sampling.top_p, sampling.min_p, top_k=sampling.top_k)
