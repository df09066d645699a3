"""One forward of the target that can also hand back its final hidden states.

An MTP drafter drafts from the target's last hidden state, so the verify pass must
expose it without a second forward. ``forward`` splits mlx-lm's ``Model.__call__`` into
its two halves (the decoder stack ``model.model`` and the output head) so the logits
are exactly those ``model(inputs, cache=cache)`` gives.
"""

from __future__ import annotations

import mlx.core as mx

from ..checkpoints.mtp import output_head


def forward(model, inputs: mx.array, cache, want_hidden: bool = False):
    """(logits, hidden or None) for `inputs` (1, L), extending `cache`.

    Without `want_hidden` this is ``model(inputs, cache=cache)`` itself; with it the same
    computation is done in two steps and the hidden states (1, L, hidden) are kept.
    """
    if not want_hidden:
        return model(inputs, cache=cache), None
    hidden = model.model(inputs, cache=cache)
    return output_head(model)(hidden), hidden
