"""DSRL: reinforcement learning in the initial-noise space of a frozen flow policy.

DSRL ("Steering Your Diffusion Policy with Latent Space Reinforcement Learning",
Wagenmaker et al., 2025) leaves a pretrained flow (or diffusion) policy untouched and trains
a small actor whose action is the policy's initial noise ``x_0``: the frozen policy's
deterministic ODE turns that noise into the chunk the robot executes. Any off-policy
algorithm for continuous actions then trains in the noise space, with no gradient through
the flow model and no change to its sampler.

Two equivalent ways to wire it into TorchRL are provided:

- **Environment side** (:class:`NoiseActionTransform`): a transform appended to the chunked
  environment replaces its action by the noise ``[*B, H, D]`` (bounded to ``[-m, m]``) and
  decodes every noise action with the frozen policy before the chunk is executed. The
  learner (stock :class:`~torchrl.objectives.SACLoss`, replay buffer, collector) never sees
  the flow model. Each environment process holds its own copy of the frozen policy.
- **Policy side** (:class:`NoiseDecoder`): a noise actor followed by a module that decodes
  its noise into the chunk; the environment stays the plain chunked environment and the loss
  reads the noise entry (``SACLoss.set_keys(action=...)``). One copy of the frozen model,
  in the policy's process, decodes the whole batch of environments at once.

Shapes: ``B`` batch dims of the environment, ``H`` the policy's chunk length, ``H'`` the
executed rows (``policy.executed_chunk_length``, the chunked environment's chunk length),
``D`` the per-step action dimension.
"""

from __future__ import annotations

import math
import numbers

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import Tensor
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.envs import Transform

from torchrl_flowpolicy.policy import FlowSDEPolicy

__all__ = [
    "NoiseActionTransform",
    "NoiseDecoder",
    "freeze_policy",
    "DECODED_ACTION_KEY",
    "NOISE_KEY",
    "DEFAULT_NOISE_BOUND",
    "NOISE_BOUND_TOLERANCE",
]

DECODED_ACTION_KEY: NestedKey = ("dsrl", "decoded_action")
NOISE_KEY: NestedKey = ("dsrl", "noise")
DEFAULT_NOISE_BOUND = 1.5
#: Relative slack on ``noise_bound`` when a noise action is checked (float rounding).
NOISE_BOUND_TOLERANCE = 1e-5


def freeze_policy(policy: FlowSDEPolicy) -> FlowSDEPolicy:
    """Freeze ``policy`` in place (``requires_grad_(False)``, eval mode) and return it."""
    policy.requires_grad_(False)
    policy.eval()
    return policy


def _check_noise(
    noise: Tensor | None, expected: tuple[int, ...], key: NestedKey, bound: float | None = None
) -> Tensor:
    """The noise action, checked: present, of shape ``expected``, finite, within ``bound``.

    ``bound`` (the transform's ``noise_bound``) is enforced up to a relative ``1e-5`` (the
    rounding of a squashed actor's ``bound * tanh``); ``None``: finite only.
    """
    if noise is None:
        raise KeyError(f"DSRL expected the noise action at {key!r}; it is missing.")
    if tuple(noise.shape) != expected:
        raise ValueError(
            f"DSRL noise action at {key!r} has shape {tuple(noise.shape)}, expected "
            f"{expected} (batch shape followed by the policy's action_shape (H, D): the full "
            f"initial noise x_0 of the chunk)."
        )
    # One reduction for both checks: NaN fails the comparison too.
    limit = math.inf if bound is None else bound * (1 + NOISE_BOUND_TOLERANCE)
    if not (noise.abs() <= limit).all():
        finite = torch.isfinite(noise)
        if not finite.all():
            raise ValueError(
                f"DSRL noise action at {key!r} is not finite ({int((~finite).sum())} NaN or "
                f"inf values): the noise actor diverged or its input is not finite."
            )
        raise ValueError(
            f"DSRL noise action at {key!r} lies outside [-noise_bound, noise_bound] "
            f"(noise_bound={bound:g}): largest |value| {noise.abs().max().item():.4g}. The "
            f"action spec is bounded; the frozen flow would decode noise it was never "
            f"trained on. Squash or clip the noise actor's output to the bound."
        )
    return noise


class NoiseActionTransform(Transform):
    """Expose a frozen flow policy's initial noise as the environment's action.

    Append it to a chunked environment (:func:`~torchrl_flowpolicy.envs.make_chunked_env`
    with ``executed_chunk_length = policy.executed_chunk_length``). The action spec becomes
    ``Bounded(-noise_bound, noise_bound)`` of shape ``[*B, H, D]``, the policy's full initial
    noise ``x_0``. Stepping decodes the noise with the frozen policy's deterministic ODE
    (:meth:`FlowSDEPolicy.decode <torchrl_flowpolicy.FlowSDEPolicy.decode>`,
    ``eval_num_denoising_steps`` Euler steps, ``no_grad``), conditioned on the observation of the same
    tensordict, and executes the resulting chunk ``[*B, H', D]``.

    The executed chunk is written as an observation entry, ``decoded_action_key``: under
    ``"next"`` it is the chunk executed by this step's noise (what a collector stores), at the
    root the chunk of the previous decision (zeros after a reset).

    The transform freezes ``policy`` in place (``requires_grad_(False)``, eval mode, kept in
    eval mode by ``train()``). It holds the policy as a submodule: an environment process
    (a :class:`~torchrl.envs.ParallelEnv` worker, a multi-process collector worker) holds
    its own copy, which costs the policy's parameter bytes per process
    (``sum(p.numel() * p.element_size() for p in policy.parameters())``) plus the ODE's
    activations for that process's batch.

    Implements the noise-space MDP of DSRL (Wagenmaker et al., 2025, "Steering Your
    Diffusion Policy with Latent Space Reinforcement Learning").

    Args:
        policy: the pretrained :class:`~torchrl_flowpolicy.FlowSDEPolicy` (frozen in place).

    Keyword Args:
        noise_bound: ``m``, the noise action lies in ``[-m, m]`` (DSRL uses about 1.5: most
            of the standard normal's mass, without its rare large values).
        action_key: the chunked environment's action key.
        noise_key: the key of the noise action (default: ``action_key``, so that stock
            losses and collectors read it as the action).
        decoded_action_key: where the executed chunk is written.

    Raises:
        ValueError: at construction, a non-positive ``noise_bound``; when the environment's
            specs are built, a chunk spec that does not match the policy (``[*B, H', D]``);
            at step time, a noise action whose shape is not ``[*B, H, D]``, that is not
            finite, or that lies outside ``[-noise_bound, noise_bound]`` (up to a relative
            ``1e-5``): it is refused, not clamped, since a noise actor that leaves its bound
            is a bug to see (a squashed actor, as DSRL's, stays within it).

    Examples:
        >>> from torchrl.envs import GymEnv
        >>> from torchrl_flowpolicy.envs import make_chunked_env
        >>> from torchrl_flowpolicy.networks import MLPVelocityNetwork
        >>> network = MLPVelocityNetwork(observation_dim=23, action_shape=(4, 7))
        >>> policy = FlowSDEPolicy(network, action_shape=(4, 7), executed_chunk_length=2)
        >>> env = make_chunked_env(GymEnv("Pusher-v5"), executed_chunk_length=2)
        >>> env = env.append_transform(NoiseActionTransform(policy))
        >>> env.action_spec.shape, env.action_spec.space.high.max().item()
        (torch.Size([4, 7]), 1.5)
        >>> rollout = env.rollout(3)  # uniform noise actions, decoded into chunks
        >>> rollout["action"].shape, rollout["next", "dsrl", "decoded_action"].shape
        (torch.Size([3, 4, 7]), torch.Size([3, 2, 7]))
    """

    def __init__(
        self,
        policy: FlowSDEPolicy,
        *,
        noise_bound: float = DEFAULT_NOISE_BOUND,
        action_key: NestedKey = "action",
        noise_key: NestedKey | None = None,
        decoded_action_key: NestedKey = DECODED_ACTION_KEY,
    ):
        noise_key = action_key if noise_key is None else noise_key
        super().__init__(
            in_keys=[],
            out_keys=[decoded_action_key],
            in_keys_inv=[action_key],
            out_keys_inv=[noise_key],
        )
        self.policy = freeze_policy(policy)
        self.noise_bound = float(noise_bound)
        self.action_key = action_key
        self.noise_key = noise_key
        self.decoded_action_key = decoded_action_key

    @property
    def noise_bound(self) -> float:
        """``m``: a finite positive number, set before the transform joins an environment
        (whose action spec is the box ``[-m, m]``)."""
        return self.__dict__["_noise_bound"]

    @noise_bound.setter
    def noise_bound(self, value: float) -> None:
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not (math.isfinite(value) and value > 0)
        ):
            raise ValueError(f"noise_bound must be a finite positive number, got {value!r}.")
        if self.__dict__.get("_container") is not None and value != self.noise_bound:
            raise ValueError(
                f"noise_bound {value}: this NoiseActionTransform already belongs to an "
                f"environment whose action spec is [-{self.noise_bound:g}, "
                f"{self.noise_bound:g}]; build a new environment instead."
            )
        self.__dict__["_noise_bound"] = float(value)

    def train(self, mode: bool = True) -> NoiseActionTransform:
        super().train(mode)
        self.policy.eval()
        return self

    # ------------------------------------------------------------------ specs
    def _chunk_shape(self) -> tuple[int, ...]:
        """The executed action's shape: ``(H', D)``, or ``(D,)`` for a single-step policy."""
        if self.policy.single_step:
            return tuple(self.policy.action_shape)
        return self.policy.executed_chunk_length, self.policy.action_shape[1]

    def transform_input_spec(self, input_spec: Composite) -> Composite:
        action_spec = input_spec["full_action_spec"]
        if self.action_key not in action_spec.keys(True, True):
            raise KeyError(
                f"NoiseActionTransform decodes into the action {self.action_key!r}, which the "
                f"environment does not have (actions: {list(action_spec.keys(True, True))})."
            )
        chunk_spec = action_spec[self.action_key]
        batch_shape = input_spec.shape
        expected = (*batch_shape, *self._chunk_shape())
        if tuple(chunk_spec.shape) != expected:
            raise ValueError(
                f"NoiseActionTransform: the environment's action {self.action_key!r} has "
                f"shape {tuple(chunk_spec.shape)}, but the policy decodes chunks of shape "
                f"{expected} (batch shape, executed_chunk_length, action dim). Append the "
                f"transform to make_chunked_env(env, policy.executed_chunk_length)."
            )
        noise_shape = (*batch_shape, *self.policy.action_shape)
        if self.noise_key != self.action_key:
            del action_spec[self.action_key]
        action_spec[self.noise_key] = Bounded(
            low=-self.noise_bound,
            high=self.noise_bound,
            shape=noise_shape,
            dtype=chunk_spec.dtype,
            device=chunk_spec.device,
        )
        input_spec["full_action_spec"] = action_spec
        return input_spec

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        observation_spec[self.decoded_action_key] = Unbounded(
            shape=(*observation_spec.shape, *self._chunk_shape()),
            dtype=torch.float32,
            device=observation_spec.device,
        )
        return observation_spec

    # ------------------------------------------------------------------ stepping
    def decode(self, tensordict: TensorDictBase) -> Tensor:
        """The chunk ``[*B, H', D]`` decoded from the noise action of ``tensordict``."""
        expected = (*tensordict.batch_size, *self.policy.action_shape)
        noise = tensordict.get(self.noise_key, None)
        noise = _check_noise(noise, expected, self.noise_key, self.noise_bound)
        return self.policy.decode(tensordict, noise)

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        chunk = self.decode(tensordict).to(torch.float32)
        tensordict.set(self.decoded_action_key, chunk)
        tensordict.set(self.action_key, chunk)
        return tensordict

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        next_tensordict.set(self.decoded_action_key, tensordict.get(self.decoded_action_key))
        return next_tensordict

    def _reset(
        self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase
    ) -> TensorDictBase:
        tensordict_reset.set(
            self.decoded_action_key,
            torch.zeros(
                (*tensordict_reset.batch_size, *self._chunk_shape()),
                device=tensordict_reset.device,
            ),
        )
        return tensordict_reset


class NoiseDecoder(TensorDictModuleBase):
    """Decode a noise entry into the chunk with a frozen flow policy (the policy-side DSRL).

    Reads the observation(s) (``policy.in_keys``) and ``noise_key`` ``[*B, H, D]``, writes
    ``action_key`` ``[*B, H', D]``: the frozen policy's deterministic ODE from that noise
    (``no_grad``). Chain it after a noise actor
    (``TensorDictSequential(noise_actor, NoiseDecoder(policy))``) to act in the plain chunked
    environment, and point the off-policy loss at the noise
    (``SACLoss(...).set_keys(action=noise_key)``). The policy is frozen in place. A noise
    entry that is not finite is refused with a ``ValueError`` naming ``noise_key`` (the noise
    actor bounds its own output: no bound is checked here).

    Args:
        policy: the pretrained :class:`~torchrl_flowpolicy.FlowSDEPolicy`.

    Keyword Args:
        noise_key: the noise entry written by the noise actor.
        action_key: where the chunk is written.

    Examples:
        >>> from tensordict import TensorDict
        >>> from torchrl_flowpolicy.networks import MLPVelocityNetwork
        >>> network = MLPVelocityNetwork(observation_dim=5, action_shape=(4, 2))
        >>> policy = FlowSDEPolicy(network, action_shape=(4, 2), executed_chunk_length=3)
        >>> decoder = NoiseDecoder(policy)
        >>> td = TensorDict(
        ...     {"observation": torch.randn(6, 5), "dsrl": {"noise": torch.randn(6, 4, 2)}}, [6]
        ... )
        >>> decoder(td)["action"].shape
        torch.Size([6, 3, 2])
    """

    def __init__(
        self,
        policy: FlowSDEPolicy,
        *,
        noise_key: NestedKey = NOISE_KEY,
        action_key: NestedKey = "action",
    ):
        super().__init__()
        self.policy = freeze_policy(policy)
        self.noise_key = noise_key
        self.action_key = action_key
        self.in_keys = [*policy.in_keys, noise_key]
        self.out_keys = [action_key]

    def train(self, mode: bool = True) -> NoiseDecoder:
        super().train(mode)
        self.policy.eval()
        return self

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        expected = (*tensordict.batch_size, *self.policy.action_shape)
        noise = _check_noise(tensordict.get(self.noise_key, None), expected, self.noise_key)
        return tensordict.set(self.action_key, self.policy.decode(tensordict, noise))
