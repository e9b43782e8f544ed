"""``FlowMatchingLoss``: supervised flow matching for pretraining and self-imitation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey
from torch import Tensor
from torchrl.objectives import LossModule

from torchrl_flowpolicy import flow
from torchrl_flowpolicy.flow import SigmaDistribution
from torchrl_flowpolicy.policy import FlowSDEPolicy

__all__ = [
    "FlowMatchingLoss",
    "flow_matching_per_sample",
    "reduce_self_imitation",
    "self_imitation_error",
]


def flow_matching_per_sample(
    policy: FlowSDEPolicy,
    tensordict: TensorDictBase,
    action: Tensor,
    *,
    row_mask: Tensor | None = None,
    sigma_distribution: SigmaDistribution = "uniform",
    context_grad: bool = True,
) -> Tensor:
    """The flow-matching error of ``policy``'s velocity network, one value per decision.

    Draws ``sigma`` (from ``sigma_distribution``) and ``noise ~ N(0, I)``, forms
    ``x = (1 - sigma) A + sigma noise`` and regresses ``v(x, sigma, context)`` on
    ``noise - A`` (Lipman et al., 2023; Liu et al., 2023), averaged over the action dimension
    and the valid rows (and the real action dimensions of the policy's ``action_mask``). A target with fewer rows than the policy's chunk (the executed rows
    of a rollout) is zero-padded to ``H`` and its missing rows are masked out. A single-step
    policy (``action_shape = (D,)``) takes targets ``[*B, D]`` (one row).

    Args:
        policy: the policy whose network and context are trained.
        tensordict: holds the observation(s); batch shape ``[*B]``.
        action: the target chunks, ``[*B, H', D]`` with ``H' <= H`` (``[*B, D]`` for a
            single-step policy).
        row_mask: ``[*B, H']`` booleans, ``True`` for real rows (default: all; ``[*B]`` for
            a single-step policy).
        sigma_distribution: see :func:`torchrl_flowpolicy.flow.sample_training_sigma`.
        context_grad: let the gradient reach the encoder.

    Returns:
        ``[*B]`` per-decision errors.
    """
    batch_shape = tensordict.batch_size
    if policy.single_step:
        if action.shape != (*batch_shape, *policy.action_shape):
            raise ValueError(
                f"the target action has shape {tuple(action.shape)}; expected batch shape "
                f"{tuple(batch_shape)} followed by the single-step action shape "
                f"{tuple(policy.action_shape)}."
            )
        action = action.unsqueeze(-2)
        row_mask = None if row_mask is None else row_mask.unsqueeze(-1)
    chunk_length, action_dim = policy.chunk_shape
    if action.shape[: len(batch_shape)] != batch_shape or action.shape[len(batch_shape) :][1:] != (
        action_dim,
    ):
        raise ValueError(
            f"the target action has shape {tuple(action.shape)}; expected batch shape "
            f"{tuple(batch_shape)} followed by (rows <= {chunk_length}, {action_dim})."
        )
    rows = action.shape[-2]
    if rows > chunk_length:
        raise ValueError(
            f"the target action has {rows} rows, more than the policy's chunk length "
            f"{chunk_length}; nothing is truncated silently: slice it first."
        )
    sampler = policy.sampler
    dtype = sampler.dtype
    action = action.reshape(-1, rows, action_dim).to(dtype)
    num_decisions = action.shape[0]
    valid = torch.ones(num_decisions, rows, dtype=torch.bool, device=action.device)
    if row_mask is not None:
        valid = row_mask.reshape(num_decisions, rows).bool()
        # Padding rows are zero, as the rows padded below: the network sees the whole chunk,
        # so their content would otherwise leak into the error of the real rows.
        action = torch.where(valid[..., None], action, torch.zeros((), dtype=dtype))
    if rows < chunk_length:
        action = torch.nn.functional.pad(action, (0, 0, 0, chunk_length - rows))
        valid = torch.nn.functional.pad(valid, (0, chunk_length - rows), value=False)
    noise = torch.randn_like(action)
    sigma = flow.sample_training_sigma(
        (num_decisions,), sigma_distribution, dtype=dtype, device=action.device
    )
    x = flow.interpolate(action, noise, sigma)
    context = policy.context(tensordict, grad=context_grad)
    velocity = flow.network_velocity(
        sampler.velocity_network, context, sampler.network_dtype, dtype
    )
    error = flow.flow_matching_error(velocity(x, sigma), action, noise, valid, sampler.action_mask)
    return error.reshape(batch_shape)


def self_imitation_error(
    policy: FlowSDEPolicy,
    tensordict: TensorDictBase,
    *,
    success_key: NestedKey = "success",
    action_key: NestedKey = "action",
    sigma_distribution: SigmaDistribution = "uniform",
    context_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    """Flow matching on the executed chunks of the decisions flagged successful.

    The self-imitation term of :class:`~torchrl_flowpolicy.objectives.DenoisingClipPPOLoss`
    (``bc_coeff``): :func:`flow_matching_per_sample` on the ``action_key`` chunks of the
    decisions whose ``success_key`` flag (``[*B]`` or ``[*B, 1]``) is set.

    Returns:
        ``(error [S], success [*B])``: the errors of the ``S`` flagged decisions in row-major
        order (empty, without a network call, when none is flagged) and the flags.
    """
    success = tensordict.get(success_key, None)
    if success is None:
        raise KeyError(f"bc_coeff > 0 needs the per-decision success flag {success_key!r}.")
    batch_shape = tensordict.batch_size
    if success.shape not in (batch_shape, (*batch_shape, 1)):
        raise ValueError(
            f"the success flag has shape {tuple(success.shape)}, expected "
            f"{tuple(batch_shape)} or {(*batch_shape, 1)}."
        )
    success = success.reshape(batch_shape).bool()
    if not success.any():
        return torch.zeros(0, device=success.device), success
    flat = tensordict.reshape(-1)[success.reshape(-1)]
    error = flow_matching_per_sample(
        policy,
        flat,
        flat.get(action_key),
        sigma_distribution=sigma_distribution,
        context_grad=context_grad,
    )
    return error, success


def reduce_self_imitation(error: Tensor, success: Tensor, reduction: str) -> Tensor:
    """Reduce :func:`self_imitation_error`'s ``error [S]`` with a loss's ``reduction``.

    ``"none"``: one value per decision ``[*B]``, zero where not successful; ``"mean"`` /
    ``"sum"`` over the ``S`` successful decisions (0 when there is none).

    Examples:
        >>> success = torch.tensor([True, False, True])
        >>> reduce_self_imitation(torch.tensor([1.0, 3.0]), success, "none")
        tensor([1., 0., 3.])
    """
    if reduction == "none":
        return error.new_zeros(success.shape).masked_scatter(success, error)
    if error.numel() == 0:
        return error.new_zeros(())
    return error.mean() if reduction == "mean" else error.sum()


class FlowMatchingLoss(LossModule):
    """The supervised flow-matching loss of a :class:`~torchrl_flowpolicy.FlowSDEPolicy`.

    Used for behaviour cloning from demonstrations and for self-imitation (see
    :class:`~torchrl_flowpolicy.objectives.DenoisingClipPPOLoss`'s ``bc_coeff``). For each
    decision: ``sigma`` from ``sigma_distribution``, ``noise ~ N(0, I)``,
    ``x = (1 - sigma) A + sigma noise``, target ``v = noise - A``; the squared error is
    averaged over the action dimension and the valid chunk rows, then reduced over the batch.

    Args:
        actor_network: the policy to train (its velocity network and encoder).

    Keyword Args:
        sigma_distribution: ``"uniform"`` (default), ``"logit_normal"`` or ``"beta"``.
        context_grad: train the encoder too (default ``True``).
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"`` (one value per decision).

    Keys (``set_keys``): ``action`` (the target chunk, ``[*B, H', D]``) and ``row_mask``
    (``[*B, H']`` booleans marking real rows; absent: all rows are real).

    Examples:
        >>> from tensordict import TensorDict
        >>> from torchrl_flowpolicy.networks import MLPVelocityNetwork
        >>> policy = FlowSDEPolicy(MLPVelocityNetwork(5, (4, 2)), action_shape=(4, 2))
        >>> loss = FlowMatchingLoss(policy)
        >>> data = TensorDict(
        ...     {"observation": torch.randn(8, 5), "action": torch.randn(8, 4, 2)}, batch_size=[8]
        ... )
        >>> loss(data)["loss_flow_matching"].shape
        torch.Size([])
    """

    @dataclass
    class _AcceptedKeys:
        """Tensordict keys read by the loss.

        Attributes:
            action: the target chunk. Defaults to ``"action"``.
            row_mask: real (non-padding) rows of the target. Defaults to ``"action_row_mask"``.
        """

        action: NestedKey = "action"
        row_mask: NestedKey = "action_row_mask"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    actor_network: FlowSDEPolicy

    def __init__(
        self,
        actor_network: FlowSDEPolicy,
        *,
        sigma_distribution: SigmaDistribution = "uniform",
        context_grad: bool = True,
        reduction: str = "mean",
    ):
        super().__init__()
        if not isinstance(actor_network, FlowSDEPolicy):
            raise TypeError(
                f"FlowMatchingLoss trains a FlowSDEPolicy, got {type(actor_network).__name__}."
            )
        flow.sample_training_sigma((1,), sigma_distribution)  # validates the name
        self.actor_network = actor_network
        self.sigma_distribution = sigma_distribution
        self.context_grad = context_grad
        self.reduction = reduction

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        pass

    @property
    def in_keys(self) -> list[NestedKey]:
        return [*self.actor_network.in_keys, self.tensor_keys.action, self.tensor_keys.row_mask]

    @property
    def out_keys(self) -> list[NestedKey]:
        return ["loss_flow_matching"]

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        action = tensordict.get(self.tensor_keys.action, None)
        if action is None:
            raise KeyError(
                f"FlowMatchingLoss needs the target chunk at {self.tensor_keys.action!r}; "
                f"set it with loss.set_keys(action=...)."
            )
        error = flow_matching_per_sample(
            self.actor_network,
            tensordict,
            action,
            row_mask=tensordict.get(self.tensor_keys.row_mask, None),
            sigma_distribution=self.sigma_distribution,
            context_grad=self.context_grad,
        )
        return TensorDict({"loss_flow_matching": self._reduce_loss(error, tensordict)})
