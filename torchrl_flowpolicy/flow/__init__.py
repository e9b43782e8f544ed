"""Flow-matching and Flow-SDE math as pure tensor functions.

This package knows nothing about TensorDicts or TorchRL: every function maps tensors to
tensors, accepts any leading batch shape and takes its randomness as an argument, so that
each formula can be tested against its closed form.

Time convention (the only one used in the library):
    ``sigma`` in [0, 1]; ``sigma = 1`` is pure noise, ``sigma = 0`` is the action.
    Interpolant ``x_sigma = (1 - sigma) * action + sigma * noise``; the network predicts the
    velocity ``v = noise - action``. Sampling integrates from sigma = 1 down to 0 with Euler
    steps ``Delta_k = sigma_{k+1} - sigma_k < 0``. Chain index k = 0..K: ``x_0`` is the initial
    noise, ``x_K`` the action chunk; step k maps ``x_k -> x_{k+1}`` using ``sigma_k``.

Shape glossary:
    ``B`` decisions (macro-steps), ``K`` denoising steps, ``H`` chunk length, ``D`` action
    dimension, ``O`` observation features.

Paper symbols and their names here:

    | paper | code |
    | --- | --- |
    | sigma (Fast-WAM), t | ``sigma`` |
    | a | ``noise_level`` |
    | g(sigma) | ``noise_std_scale`` |
    | Delta_k | ``step_size`` (negative) |
    | mu_k, std_k | ``mean``, ``std`` |
    | s(x_k, sigma_k, c) (learned std) | ``noise_std``, ``step_std`` |
    | grad log p_sigma(x) | ``score`` |

The Flow-SDE step is the reverse-time SDE of Song et al. (2021) that shares the marginals of
the probability-flow ODE, with the noise schedule of Flow-GRPO (Liu et al., 2025) and pi-RL
(Flow-SDE, Chen et al., 2025); see ``docs/conventions.md`` for the derivation.

Modules: :mod:`~torchrl_flowpolicy.flow.sde` (the grid, the Flow-SDE step, the stochastic
steps, the settings' check), :mod:`~torchrl_flowpolicy.flow.gaussian` (the Gaussian log-density, entropy and KL,
with an action mask), :mod:`~torchrl_flowpolicy.flow.noise` (the bounded std of the learned
exploration noise), :mod:`~torchrl_flowpolicy.flow.sampling` (the sampling schedule, the one
integration loop), :mod:`~torchrl_flowpolicy.flow.rescoring` (the learner's rescoring of
stored chains) and :mod:`~torchrl_flowpolicy.flow.training` (the flow-matching target).
Every name is re-exported here: ``from torchrl_flowpolicy import flow; flow.sigma_grid(8)``.
"""

from torchrl_flowpolicy.flow import gaussian, noise, rescoring, sampling, sde, training
from torchrl_flowpolicy.flow.gaussian import *  # noqa: F403
from torchrl_flowpolicy.flow.noise import *  # noqa: F403
from torchrl_flowpolicy.flow.rescoring import *  # noqa: F403
from torchrl_flowpolicy.flow.sampling import *  # noqa: F403
from torchrl_flowpolicy.flow.sde import *  # noqa: F403
from torchrl_flowpolicy.flow.training import *  # noqa: F403

__all__ = [
    *sde.__all__,
    *gaussian.__all__,
    *noise.__all__,
    *sampling.__all__,
    *rescoring.__all__,
    *training.__all__,
]
