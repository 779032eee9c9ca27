"""Routing for fused MoE experts: which routed rows go to which expert, grouped by expert.

:class:`~fp8train.nn.modules.experts.Float8Experts` gathers each expert's rows into one padded
group per expert, runs the experts' GEMMs on the groups, and adds the rows back into their
tokens, weighted: the gather and the sum once for all experts (see its module docstring).
"""

from __future__ import annotations

import torch

from ...spec.granularities import round_up

__all__ = ["ExpertRoutes"]


class ExpertRoutes:
    """Which rows go to which expert, grouped by expert.

    A routed row is one (token, top-k slot) pair whose expert id is below ``num_experts``.
    Rows are grouped by expert in ascending order and, within an expert, ordered by slot,
    then token: the order of transformers' eager loop (``torch.where`` over its
    ``[k, T]`` mask). Each expert's group is zero-padded to ``alignment`` rows.

    Attributes:
        token_index: int64 ``[rows]``, each routed row's token.
        slot: int64 ``[rows]``, its top-k slot.
        counts: rows per expert, ``[E]`` (a Python list: the loop over experts reads it).
        padded_counts: the same, each rounded up to ``alignment``.
        padded_position: int64 ``[rows]``, each row's index in the padded groups.
    """

    def __init__(self, top_k_index: torch.Tensor, num_experts: int, alignment: int) -> None:
        num_tokens = top_k_index.shape[0]
        # Row r = slot * T + token: a stable sort by expert keeps each expert's rows in
        # (slot, token) order. Ids >= num_experts (expert parallelism's sentinel) sort last
        # and fall outside every count.
        expert_of_row = top_k_index.t().reshape(-1).clamp(max=num_experts)
        expert_sorted, order = torch.sort(expert_of_row, stable=True)
        counts = torch.bincount(expert_sorted, minlength=num_experts + 1)[:num_experts]
        # The one read on the host a routing needs (the loop over experts and the splits
        # take the counts); what follows from them on the device stays there.
        self.counts = counts.tolist()
        self.num_rows = sum(self.counts)
        self.padded_counts = [round_up(n, alignment) for n in self.counts]
        order = order[: self.num_rows]
        self.token_index = order % max(num_tokens, 1)
        self.slot = torch.div(order, max(num_tokens, 1), rounding_mode="floor")
        # Padded position = row + (padding of the experts before its own).
        padding = round_up(counts, alignment) - counts  # on the device: round_up is plain arithmetic
        padding_before = torch.cumsum(padding, 0) - padding
        expert_sorted = expert_sorted[: self.num_rows]
        self.padded_position = torch.arange(self.num_rows, device=order.device) + padding_before[expert_sorted]
        self.num_padded_rows = sum(self.padded_counts)

    def active(self, per_expert, groups):
        """``(expert, item, group)`` for each expert with rows, in order: ``per_expert`` and
        ``groups`` (a split by the counts) hold one item per expert."""
        return ((e, item, group) for e, (item, group, n) in enumerate(zip(per_expert, groups, self.counts)) if n)

    def gather_padded(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[padded rows, H]``: each routed row's token, padding rows zero."""
        rows = hidden_states[self.token_index]
        if self.num_padded_rows == self.num_rows:
            return rows
        padded = rows.new_zeros(self.num_padded_rows, rows.shape[-1])
        return padded.index_copy(0, self.padded_position, rows)

    def combine(self, output: torch.Tensor, rows: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Add each routed row ``[rows, H]``, times its router weight, into its token of
        ``output`` (in row order: each token's experts in ascending order, as the eager loop)."""
        weighted = rows * top_k_weights[self.token_index, self.slot, None]
        return output.index_add_(0, self.token_index, weighted.to(output.dtype))
