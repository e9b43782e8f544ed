"""Optional bridges to other libraries' action experts, imported only when used.

- :mod:`~torchrl_flowpolicy.integrations.lerobot`: LeRobot's pi0, pi0.5 and SmolVLA as a
  :class:`~torchrl_flowpolicy.FlowSDEPolicy` (``pip install "torchrl_flowpolicy[lerobot]"``,
  Python >= 3.12; see ``docs/lerobot.md``).
- :mod:`~torchrl_flowpolicy.integrations.lerobot_models`: those policies built offline with
  random weights at a chosen size (tests, benchmarks, architecture experiments).

Nothing here is imported by the rest of the package.
"""
